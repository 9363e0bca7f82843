"""Validation: a model run on each backend and compared with its source or its float64 oracle.

==============  ===========================================================================
run             ``validate_model``: the whole run, from the model file to the report
backends        ``Backend`` and ``BACKENDS``: what each ``--providers`` key runs, its label,
                its tolerance column and its runner
feeds           inputs from the metadata, the graph or an ``.npz`` file, checked against it
norms           the norms checked one by one: boundary tensors exposed, what ONNX Runtime ran
rows            ``ValidationRun`` and its comparison rows (outputs, the static contract, each
                norm against its source's spec or, without one, its own: self-consistency)
report          ``CheckRow``, ``NormReport``, ``ValidationReport`` (table and JSON), the verdict
                (passed, failed, not verified) and its exit code
audit           ``audit_file``: every norm reduction as written and as ONNX Runtime runs it (the
                ``audit`` command), ``AuditReport``
lowering_sweep  the ``parity`` command's sweep: the standalone model of each lowering in
                ONNX Runtime CPU against the float64 oracle
==============  ===========================================================================
"""
