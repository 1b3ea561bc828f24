"""marlin-workbench: the Marlin family of mixed-precision weight formats, as index maps, references, kernels and
pictures. Start with ``workbench.ops`` (the public ops) and ``workbench.formats`` (the spec)."""

__version__ = "0.1.0"
# Version of the on-disk Marlin checkpoint layout written by ``workbench repack``.
FORMAT_VERSION = "1"


def load(path, **kwargs):
    """``{layer name: MarlinWeight}`` from a Marlin or source checkpoint (see ``workbench.checkpoint.load``)."""
    from workbench.checkpoint import load as _load

    return _load(path, **kwargs)
