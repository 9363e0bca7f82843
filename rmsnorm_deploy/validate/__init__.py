"""Validation: a model run on each backend and compared with its source or its float64 oracle.

==============  ===========================================================================
run             ``validate_model``: outputs and every norm, on each backend
lowering_sweep  the ``parity`` command's sweep: the standalone model of each lowering in
                ONNX Runtime CPU against the float64 oracle
==============  ===========================================================================
"""
