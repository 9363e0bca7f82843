"""What the two HTTP APIs of ``serve`` (KServe's front, the OpenAI API) share.

==============  ===============================================================================
body            ``read_body`` / ``read_plain_body``: a request's body within a size limit (413),
                a time limit (408) and its ``Content-Encoding`` (gzip, deflate); a client gone
                mid-body is one log line; ``BodyRefused``
uvicorn_thread  ``listening_socket`` (a port in use is one line naming its flag, Nagle off) and
                ``UvicornThread``: an ASGI app on uvicorn in an event loop on its own thread
framing         ``framing_protocol``: uvicorn's h11 protocol answering a request it cannot
                frame (negative or conflicting Content-Length, bad chunks) in the API's JSON
                error shape instead of plain text
==============  ===============================================================================
"""
