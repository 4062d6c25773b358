"""A bf16 checkpoint kept at 2 bytes a weight (blockcodes.py width 16) against the fp32 copy loaded before.

    python bench/loading/bf16_checkpoint.py --threads 2 --out bench/results/weights16/smollm2_bf16_4k_pg1342.json

Writes a bf16 copy of a Hugging Face folder (default: the embedded SmolLM2-135M-Instruct's fp32 folder, rounded to
bf16 as the hub publishes it) to ``--bf16-folder`` unless it is there, then reports, in one process:
- ``load``: seconds, peak RSS (MiB) and weight MiB of ``load_model`` on the bf16 folder;
- ``one_row``: median ms of a one-row product of the LM head and layer 0's matrices, 2-byte weights
  (``blockcode_linear``) against our fp32 kernel over the widened copy (``f32_linear``), bitwise equal outputs;
- ``decode``: ms/token of our autoregressive decoding (greedy, ``--new-tokens`` after the first ``--prompt-tokens``
  of ``--book``), the model on 2-byte weights against the same weights widened to an fp32 copy (the loader's
  behaviour before), repetitions interleaved, medians; and whether both generated the same tokens.
JSON on stdout (and to ``--out``). transformers' and ``auto``'s rows come from ``triforce bench --model <bf16 folder>``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path

import triforce  # noqa: F401  (first: sets OpenMP's spin before torch loads it, as the product does)

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common.py
from common import _interleaved, add_run_options, emit_json, timed_load  # noqa: E402


def write_bf16_copy(src: Path, dst: Path) -> None:
    """``src``'s safetensors rounded to bf16 (floating tensors only) into ``dst``, with its config and tokenizer."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(str(f)).items()}
            save_file(state, str(dst / f.name), metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy(f, dst / f.name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a Hugging Face folder (default: the embedded SmolLM2's)")
    p.add_argument("--bf16-folder", default="/tmp/triforce-bf16/model", help="where the bf16 copy is written")
    p.add_argument("--book", default="pg1342.txt")
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--new-tokens", type=int, default=64)
    add_run_options(p, out=None, reps=3, sampling=False)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from triforce.engine import Engine
    from triforce.formats.download import download_default_model
    from triforce.kernels.blockcodes import blockcode_linear
    from triforce.kernels.cpu import f32_linear
    from triforce.kernels.stored import dense_weight_t
    from triforce.lab.books import BOOKS_DIR
    from triforce.speculation.sampling import SamplingParams
    from triforce.text.prompts import strip_gutenberg

    src = Path(args.model).expanduser() if args.model else Path(download_default_model())
    dst = Path(args.bf16_folder).expanduser()
    if not any(dst.glob("*.safetensors")):
        write_bf16_copy(src, dst)

    lm, load = timed_load(dst)
    stored = lm.model

    one_row = {}
    for name, lin in (("lm_head", stored.lm_head), ("layer0.gate_up", stored.layers[0].mlp.gate_up_proj),
                      ("layer0.down", stored.layers[0].mlp.down_proj),
                      ("layer0.qkv", stored.layers[0].self_attn.qkv_proj)):
        codes, w_t = lin.codes, dense_weight_t(lin)
        x = torch.randn(1, codes.in_features)
        assert torch.equal(blockcode_linear(x, codes), f32_linear(x, w_t))
        s = _interleaved({"two_byte": lambda: blockcode_linear(x, codes), "fp32": lambda: f32_linear(x, w_t)},
                         args.reps * 7)
        one_row[name] = {"ms_two_byte": s["two_byte"] * 1e3, "ms_fp32": s["fp32"] * 1e3,
                         "mib_two_byte": codes.nbytes / 2**20, "mib_fp32": w_t.numel() * 4 / 2**20}

    # the loader's model before: every weight widened to an fp32 copy
    from safetensors.torch import load_file

    from triforce.model.transformer import Transformer

    state = {}
    for f in sorted(dst.glob("*.safetensors")):
        state.update({k: v.float() for k, v in load_file(str(f)).items()})
    widened = Transformer.from_state_dict(stored.cfg, state, consume=True)
    widened.attach_block_codes()

    text = strip_gutenberg(open(f"{BOOKS_DIR}/{args.book}", encoding="utf-8").read())
    ids = lm.tokenizer(text).input_ids[:args.prompt_tokens]
    greedy = SamplingParams(temperature=0)
    engines = {"two_byte": Engine(stored), "fp32_copy": Engine(widened)}
    decode: dict[str, list[float]] = {n: [] for n in engines}
    tokens = {}

    def run(name):
        out, stats = engines[name].generate(ids, max_new_tokens=args.new_tokens, sampling=greedy)
        decode[name].append(stats.mean_time_between_tokens_ms)
        tokens[name] = out

    _interleaved({n: (lambda n=n: run(n)) for n in engines}, args.reps)
    emit_json({"benchmark": "bf16_checkpoint", "source": str(src), "bf16_folder": str(dst), "threads": args.threads,
               "book": args.book, "prompt_tokens": len(ids), "new_tokens": args.new_tokens, "reps": args.reps,
               "load": load, "one_row": one_row,
               "decode_ms_per_token": {n: statistics.median(v[1:]) for n, v in decode.items()},
               "same_tokens": tokens["two_byte"] == tokens["fp32_copy"]}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
