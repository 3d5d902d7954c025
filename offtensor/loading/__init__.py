"""load_safetensors / from_pretrained: fill a model built on meta straight from safetensors files.

Placement is planned from the meta shapes before a byte is read, so each weight goes from the file
into its destination in one pass: an offloaded one into its exact-size host master, a resident one
to the device through reused staging buffers. Every header is checked against the file and the
model first, so a bad checkpoint is refused before the model changes; a read that fails later also
leaves it unchanged, because tensors are swapped into the model only after every byte has arrived.
Each file's header, parsed and checked (and ``CheckpointError``), is ``offtensor/safetensors_files.py``'s,
and which files a path names ``offtensor/safetensors_paths.py``'s, at the bottom of the package,
where readers of safetensors files below the loader can use them too.

    names.py       how the files' names and dtypes map onto the model's tensors, and every mismatch
    ties.py        a transformers checkpoint's tied weights, decided from the files as transformers does
    configs.py     config.json checked, and the model built on meta and matched, before any allocation
    registrations.py  how much a build may register, given the files it must match (counted as it runs)
    scoped.py      registration hooks that act for one thread's block, bound to the frame that entered it
    read.py        the threaded reader: pieces into host masters and, staged, into device buffers
    load.py        load_safetensors: check, choose the placement, read, then change the model
    pretrained.py  from_pretrained: a transformers directory -> its model on meta, then load
"""

from ..safetensors_files import CheckpointError, read_header
from .load import load_safetensors
from .pretrained import from_pretrained

__all__ = ["CheckpointError", "load_safetensors", "from_pretrained", "read_header"]
