"""Backend implementations; each registers itself with :mod:`flash_dmattn.registry`."""
from .. import registry
from .flex import FlexBackend
from .reference import ReferenceBackend

registry.register_backend(FlexBackend())
registry.register_backend(ReferenceBackend())
