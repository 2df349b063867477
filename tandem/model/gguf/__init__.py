"""GGUF model files: config and tokenizer extracted once, weights read in place.

``gguf_to_hf_dir`` (``convert``) writes ``config.json``,
``generation_config.json`` and the tokenizer files in transformers' layout
into the cache once, from the metadata ``metadata`` reads and checks. The
weights are not converted: ``GGUFWeights`` (``weights``) reads them from the
memory-mapped file one tensor at a time, in their own block formats (Q8_0 as
int8 and Q4_0 / Q4_1 / Q4_K as int4 exactly, other block formats requantized
to int8 in groups of 32: ``blocks``; F16 / BF16 / F32 as floats), so a
multi-GB model never has an fp32 copy. ``weights=True`` also writes an fp32
``model.safetensors``, for HF transformers as the correctness reference.
"""

from tandem.model.gguf.convert import gguf_to_hf_dir
from tandem.model.gguf.weights import GGUFWeights

__all__ = ["GGUFWeights", "gguf_to_hf_dir"]
