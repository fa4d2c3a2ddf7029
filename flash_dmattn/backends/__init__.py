"""Backend implementations; each registers itself with :mod:`flash_dmattn.registry`."""
from .. import registry
from .cuda.backend import CudaBackend
from .flex import FlexBackend
from .reference import ReferenceBackend
from .triton.backend import TritonBackend

registry.register_backend(CudaBackend())
registry.register_backend(TritonBackend())
registry.register_backend(FlexBackend())
registry.register_backend(ReferenceBackend())
