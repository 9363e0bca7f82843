"""rmsnorm-deploy: RMSNorm from PyTorch to ONNX, ONNX Runtime and TensorRT, numerics guaranteed.

The data flows spec -> reference / ONNX function -> lowering -> model -> runner -> comparison.
Only torch, onnx and onnxscript are needed to import this package; onnxruntime, tensorrt,
triton and transformers are loaded when a feature that needs them is used.
"""

from rmsnorm_deploy.contract.spec import RMSNormSpec
from rmsnorm_deploy.errors import UserError
from rmsnorm_deploy.resources import __version__

__all__ = ["RMSNormSpec", "UserError", "rmsnorm_model", "reference", "oracle", "__version__"]


def __getattr__(name: str):
    # Heavier pieces load on first use so that `import rmsnorm_deploy` stays light.
    if name == "rmsnorm_model":
        from rmsnorm_deploy.graph.standalone import rmsnorm_model  # start-up: onnxscript loads on first use

        return rmsnorm_model
    if name in ("reference", "oracle"):
        from rmsnorm_deploy.contract import reference as _reference  # start-up: torch loads on first use

        return getattr(_reference, name)
    raise AttributeError(f"module 'rmsnorm_deploy' has no attribute {name!r}")
