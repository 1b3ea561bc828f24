"""``workbench example-checkpoint DIR``: a small quantized checkpoint to try ``inspect``, ``repack``, ``verify`` and
the explorer on, written the way the producing tool writes it (``workbench.checkpoint.synthetic``).

The model is one Llama-style decoder layer with hidden size 128 and MLP width 256, so that every layer fits the
layout explorer (K <= 128, N <= 256 for the attention and gate/up projections) and the whole directory is a few
hundred kilobytes; the weights are random normal from a fixed seed, so the same command writes the same bytes.
"""
from __future__ import annotations

import argparse
import os

from workbench.checkpoint import synthetic
from workbench.checkpoint.settings import AWQ, CT, FP8, GPTQ, GPTQ_V2

FORMATS = (GPTQ, GPTQ_V2, AWQ, CT, FP8)
HIDDEN, INTERMEDIATE = 128, 256  # Marlin needs K % 128 == 0 and N % 64 == 0; the explorer draws K <= 128, N <= 256
LAYERS = {  # prefix -> (K, N) of the [K, N] weight
    "model.layers.0.self_attn.q_proj": (HIDDEN, HIDDEN),
    "model.layers.0.self_attn.k_proj": (HIDDEN, HIDDEN),
    "model.layers.0.self_attn.v_proj": (HIDDEN, HIDDEN),
    "model.layers.0.self_attn.o_proj": (HIDDEN, HIDDEN),
    "model.layers.0.mlp.gate_proj": (HIDDEN, INTERMEDIATE),
    "model.layers.0.mlp.up_proj": (HIDDEN, INTERMEDIATE),
    "model.layers.0.mlp.down_proj": (INTERMEDIATE, HIDDEN),
}
DEFAULT_SEED = 0


def example_options(fmt: str = GPTQ, bits: int = 4, group_size: int = 128, act_order: bool = False,
                    sym: bool = True) -> synthetic.Options:
    """The synthetic-writer options for one example, with each rule checked here so the message names the flag."""
    if fmt not in FORMATS:
        raise ValueError(f"format = {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == FP8:
        if bits != 8 or group_size != 128 or act_order or not sym:
            raise ValueError(f"format {FP8} is E4M3 with 128x128 blocks: it takes no --bits {bits},"
                             f" --group-size {group_size}, --act-order or --asymmetric")
        return synthetic.Options(fmt=FP8, bits=8, group_size=128)
    if bits not in (4, 8):
        raise ValueError(f"--bits {bits} is not 4 or 8 (the Marlin integer formats)")
    if group_size not in (-1, 32, 64, 128):
        raise ValueError(f"--group-size {group_size} is not -1 (channelwise), 32, 64 or 128")
    if fmt == AWQ and (act_order or bits != 4):
        raise ValueError(f"format {AWQ} (AutoAWQ GEMM) is 4-bit with zero points and no act-order: got --bits {bits}"
                         + (", --act-order" if act_order else ""))
    if act_order and group_size == -1:
        raise ValueError("--act-order needs groups: --group-size -1 has a single group, so there is nothing to order")
    return synthetic.Options(fmt=fmt, bits=bits, group_size=group_size, act_order=act_order,
                             sym=sym if fmt != AWQ else False)


def write_example(out_dir, opt: synthetic.Options | None = None, *, force: bool = False,
                  seed: int = DEFAULT_SEED) -> str:
    """Write the example checkpoint to ``out_dir`` (refusing a non-empty directory unless ``force``)."""
    out_dir = os.fspath(out_dir)
    if os.path.isfile(out_dir):
        raise FileExistsError(f"{out_dir} is a file; give a directory for the example checkpoint")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not force:
        raise FileExistsError(f"{out_dir} exists and is not empty; choose another directory or pass --force")
    return synthetic.random_model(out_dir, opt or example_options(), LAYERS, seed=seed)


def _command(args) -> int:
    opt = example_options(args.format, args.bits if args.bits is not None else (8 if args.format == FP8 else 4),
                          args.group_size, args.act_order, not args.asymmetric)
    write_example(args.dir, opt, force=args.force, seed=args.seed)
    kind = f"{opt.fmt}, {opt.bits}-bit" + ("" if opt.fmt == FP8 else f", group size {opt.group_size}")
    kind += (", act-order" if opt.act_order else "") + (", with zero points" if not opt.sym else "")
    print(f"wrote {args.dir}: {len(LAYERS)} quantized layers ({kind}), an embedding and a norm")
    print(f"next: workbench inspect {args.dir}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "example-checkpoint", help="write a small quantized checkpoint to try the other commands on",
        description=f"Write a small quantized checkpoint (one Llama-style decoder layer, hidden size {HIDDEN}) into"
                    " DIR, in the layout the producing tool writes: GPTQ (AutoGPTQ), gptq_v2, AWQ (AutoAWQ GEMM),"
                    " compressed-tensors pack-quantized (llm-compressor) or block-FP8 (DeepSeek-V3 style).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("dir", help="output directory (created; must be empty unless --force)")
    p.add_argument("--format", choices=FORMATS, default=GPTQ, help="checkpoint format")
    p.add_argument("--bits", type=int, default=None, help="4 or 8 (block-fp8: 8)")
    p.add_argument("--group-size", type=int, default=128, help="-1 (channelwise), 32, 64 or 128")
    p.add_argument("--act-order", action="store_true", help="GPTQ desc_act / compressed-tensors actorder")
    p.add_argument("--asymmetric", action="store_true", help="zero points (u4 / u8 instead of u4b8 / u8b128)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the random weights")
    p.add_argument("--force", action="store_true", help="write into a non-empty directory")
    p.set_defaults(func=_command)
