"""Train a small causal byte-level LM on real text that every machine here has: Python source files.

    python benchmarks/train_small_lm.py --smoke --out-dir /tmp/lm          # CPU: tiny model, a few steps, seconds
    PYTHONPATH=. python benchmarks/train_small_lm.py --out-dir "$OUT"       # GPU: about 6 minutes of steps

Why this exists: no model weights or datasets can be downloaded here, yet sparse prefill is only worth measuring
on *real* attention patterns. Python source has long-range structure (imports, identifiers, repeated code,
docstrings that name functions defined far above), so a byte-level model trained on contexts of 4K-32K bytes
learns to look far back and copy (induction heads): the attention that sparse methods must not lose.

Data: the ``*.py`` files under ``sysconfig.get_paths()`` stdlib and site-packages (purelib/platlib), walked in
sorted order, 256 B to 1 MB each. Split by file: a file is held out iff the first 8 bytes of
sha1(relative path) mod 1000 < 30 (3 %); held-out files are never read for training, and training files whose
content equals a held-out file's are dropped (vendored copies). Training files are read in path-hash order up
to ``--max-train-bytes``. The device machine (Python 3.12, torch, transformers, jax, ...) has a different corpus
from this CPU machine, so the JSON records the manifest, including the long held-out files (path, size, sha1)
that ``quality.py`` and ``attention_map.py`` evaluate on: they re-read exactly those files and check the hashes.

Model: ``tests/models.py``'s Transformer (RoPE, GQA, SDPA causal attention) with head_dim 64 so that the
sparse kernels apply. Training: AdamW (``--retrieval``: Muon for the blocks' weight matrices), cosine LR with
warm-up, bf16 autocast, fixed seed, a length curriculum
(4K then 16K then 32K contexts, about the same tokens per step; ``--retrieval``: 4K, 16K, then steps that cycle
through 16K / 32K / 64K, so the model does not end on one length), and a step count calibrated from measured
step times so that the run fits a wall-clock budget. The checkpoint stores bf16 weights (a few MB).
``--retrieval --families``: the windows carry ``retrieval_families.py``'s training families instead of the
styles' tasks (checkpoint ``retrieval_families_lm.pt``), and the evaluation reports training and held-out
families apart.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # lm_*.py and retrieval_tasks, when imported from elsewhere
DEFAULT_CHECKPOINT = REPO / "benchmarks" / "checkpoints" / "small_lm.pt"

from lm_corpus import build_corpus  # noqa: E402
from lm_optimizers import lr_at, make_optimizers, median_after_warmup, optimizer_step_seconds  # noqa: E402
from lm_retrieval_training import _retrieval_batches, evaluate_families, evaluate_retrieval  # noqa: E402


# --- model and checkpoint ---------------------------------------------------------------------------------------
GPU_MODEL = dict(vocab_size=256, dim=256, n_layers=6, n_heads=4, n_kv_heads=2, intermediate_size=512,
                 rope_base=100000.0)
SMOKE_MODEL = dict(vocab_size=256, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=256,
                   rope_base=100000.0)
# --retrieval: the attention geometry of production models (head dim 128, GQA 4:1, RoPE) in a model whose bf16
# checkpoint stays under 16 MB; RoPE's base is raised for 64K contexts (``--conv-width 4`` adds a short causal
# convolution before each attention: not better on 32 instances per task, docs/results.md)
RETRIEVAL_MODEL = dict(vocab_size=256, dim=512, n_layers=4, n_heads=4, n_kv_heads=1, intermediate_size=768,
                       rope_base=500000.0)
RETRIEVAL_SMOKE_MODEL = dict(vocab_size=256, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=256,
                             rope_base=500000.0)


def load_model_module():
    """``tests/models.py`` (the small Transformer the tests and these benchmarks share) under a private module name."""
    name = "_sparse_compile_test_models"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / "models.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def save_checkpoint(model, path: Path, meta: dict) -> int:
    """bf16 weights + the ModelArgs: small enough to commit. Returns the file size in bytes."""
    state = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": 1, "model_args": dataclasses.asdict(model.args), "state_dict": state, "meta": meta}, path)
    return path.stat().st_size


def load_checkpoint(path, device="cpu", dtype=torch.float32):
    """(model in eval mode on ``device``/``dtype``, checkpoint dict)."""
    mod = load_model_module()
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model = mod.Transformer(mod.ModelArgs(**ckpt["model_args"]))
    model.load_state_dict({k: v.float() for k, v in ckpt["state_dict"].items()})
    return model.to(device=device, dtype=dtype).eval(), ckpt


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


# --- training -----------------------------------------------------------------------------------------------
def _batches(stream: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of seq_len + 1 bytes (they may cross document boundaries, marked by byte 0)."""
    start = torch.randint(0, stream.numel() - seq_len - 1, (batch, 1), generator=gen, device=stream.device)
    idx = start + torch.arange(seq_len + 1, device=stream.device)
    window = stream[idx].long()
    return window[:, :-1], window[:, 1:]


@contextlib.contextmanager
def fused_attention_for_training(device: torch.device):
    """Training only: K/V repeated for GQA and SDPA's math backend excluded on the GPU.

    The math backend would build (N x N) scores: at 32K with batch 2 that is gigabytes per layer, silently.
    Repeating K/V (a few MB here) lets every fused backend apply whatever its GQA support in this torch version;
    excluding math turns a missing fused kernel into an error instead of a slow run. Evaluation scripts run the
    model unchanged (native GQA), as a user would.
    """
    orig = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if enable_gqa and k.shape[1] != q.shape[1]:
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return orig(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)

    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        if device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                              SDPBackend.EFFICIENT_ATTENTION]):
                yield
        else:
            yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = orig


def _loss(model, x, y, amp: bool, weight: Optional[torch.Tensor] = None):
    """Mean next-byte loss; with ``weight`` (per target), (weighted mean to train on, plain mean to report)."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        logits = model(x)
    if weight is None:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    per_byte = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    weight = weight.reshape(-1)
    return (per_byte * weight).sum() / weight.sum(), per_byte.mean()


@torch.no_grad()
def evaluate_stream(model, stream, seq_len, batch, windows, seed, amp) -> float:
    """Mean next-byte loss (nats) over ``windows`` random windows of a byte stream (fixed seed)."""
    model.eval()
    gen = torch.Generator(device=stream.device).manual_seed(seed)
    total, n = 0.0, 0
    while n < windows:
        b = min(batch, windows - n)
        x, y = _batches(stream, seq_len, b, gen)
        total += float(_loss(model, x, y, amp)) * b
        n += b
    model.train()
    return total / max(n, 1)


@dataclasses.dataclass(frozen=True)
class Phase:
    """A stretch of training: its steps cycle through ``shapes`` ((seq_len, batch) each, in turn) for ``share`` of
    the time budget (or of the step count). One shape is a plain phase; several mix context lengths step by step."""

    shapes: tuple[tuple[int, int], ...]
    share: float

    @property
    def label(self) -> str:
        return "|".join(f"{seq}x{batch}" for seq, batch in self.shapes)


def parse_phases(text: str) -> list[Phase]:
    """'4096x16:0.6,16384x4|65536x1:0.4' -> phases; '|' mixes shapes within a phase (steps alternate between them).
    Shares are normalised to sum to 1."""
    phases = []
    for part in text.split(","):
        shape_text, share = part.split(":")
        shapes = []
        for shape in shape_text.split("|"):
            seq, batch = shape.lower().split("x")
            shapes.append((int(seq), int(batch)))
        phases.append(Phase(tuple(shapes), float(share)))
    total = sum(p.share for p in phases)
    return [dataclasses.replace(p, share=p.share / total) for p in phases]


def phase_shapes(phases: list[Phase]) -> list[tuple[int, int]]:
    """Every (seq_len, batch) the phases use, once each, in first-use order."""
    return list(dict.fromkeys(shape for p in phases for shape in p.shapes))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU-sized: tiny model, a few steps, seconds")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_CHECKPOINT.parent)
    parser.add_argument("--name", default="small_lm")
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--phases", default=None,
                        help="length curriculum 'SEQxBATCH:SHARE,...' (share of the time budget, or of --steps); "
                             "'SEQxBATCH|SEQxBATCH:SHARE' is a phase whose steps cycle through its shapes")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds of training steps; the step count is calibrated from measured step times")
    parser.add_argument("--steps", type=int, default=None, help="fixed total step count (overrides --time-budget)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop training after this many seconds whatever the step count (recorded as stopped)")
    parser.add_argument("--phase-steps", type=int, nargs="+", default=None, metavar="N",
                        help="fixed step count of each phase (overrides the calibrated or --steps counts): a "
                             "timed run's recorded counts repeat its schedule; the calibration still runs, so the "
                             "training data are the timed run's")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default=None,
                        help="muon: orthogonalised momentum for the blocks' weight matrices, AdamW for the rest "
                             "(default: muon with --retrieval, which trained the committed model 4; adamw otherwise)")
    parser.add_argument("--muon-lr", type=float, default=0.02, help="--optimizer muon: peak rate of Muon's groups")
    parser.add_argument("--warmup", type=int, default=150)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--max-train-bytes", type=int, default=None)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--eval-windows", type=int, default=None)
    parser.add_argument("--retrieval", action="store_true",
                        help="the retrieval model: production attention geometry, code mixed with retrieval tasks")
    parser.add_argument("--task-share", type=float, default=0.8,
                        help="--retrieval: share of training windows that carry a retrieval instance")
    parser.add_argument("--styles", nargs="+", default=None,
                        help="--retrieval: prompt styles trained on (retrieval_tasks.STYLES; default: all)")
    parser.add_argument("--families", action="store_true",
                        help="--retrieval: train on retrieval_families' training families (and code) instead of "
                             "the styles' tasks; the evaluation (and --evaluate's) then scores every family, "
                             "training and held-out apart")
    parser.add_argument("--answer-weight", type=float, default=16.0,
                        help="--retrieval: loss weight of a retrieved value byte per 4K of context (0: plain mean)")
    parser.add_argument("--layers", type=int, default=None,
                        help="number of transformer layers (default: the chosen model's n_layers)")
    parser.add_argument("--task-weights", type=float, nargs=4, default=None,
                        metavar=("PASSKEY", "MULTIKEY", "MULTIVALUE", "RECALL"),
                        help="--retrieval: relative draw frequency of each task (default: uniform)")
    parser.add_argument("--evaluate", type=Path, default=None, metavar="CHECKPOINT",
                        help="no training: the retrieval evaluation of a saved checkpoint (--eval-instances per task "
                             "and length, 16K / 32K / 64K; --smoke: 1K / 2K), written to <out-dir>/<name>_eval.json; "
                             "--seed draws other instances than training's own evaluation")
    parser.add_argument("--eval-instances", type=int, default=None,
                        help="retrieval instances per task and length, --evaluate's and training's own final "
                             "evaluation (default 32; --smoke: 2; with --families: per family, 8; --smoke: 1)")
    parser.add_argument("--extra-lookups", type=float, default=12.0,
                        help="--retrieval: lookups added to each training instance per 64K bytes, "
                             "queried before the task's own (more supervised long-range lookups per step; 0: none; "
                             "--families: queries added to the 3 of each instance)")
    parser.add_argument("--extra-list-share", type=float, default=0.5,
                        help="--retrieval: share of the extra lookups that are three-value lists (multi-value's form)")
    parser.add_argument("--extra-near-miss-share", type=float, default=0.0,
                        help="--retrieval: share of windows whose extra lookups' keys share their first four digits")
    parser.add_argument("--attn-temperature", type=int, default=None, metavar="FLOOR",
                        help="long-context attention temperature from this many positions on "
                             "(ModelArgs.attn_temperature_floor; 0: none; default: the chosen model's)")
    parser.add_argument("--conv-width", type=int, default=None,
                        help="short causal convolution before each attention (ModelArgs.conv_width; 0: none; "
                             "default: the chosen model's)")
    args = parser.parse_args(argv)
    if args.retrieval and args.name == "small_lm":  # --families does not overwrite the styles' model
        args.name = "retrieval_families_lm" if args.families else "retrieval_lm"
    if args.optimizer is None:
        args.optimizer = "muon" if args.retrieval else "adamw"

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    smoke = args.smoke
    default_phases = (("1024x2:0.5,2048x1:0.5" if args.retrieval else "256x4:0.5,512x2:0.5") if smoke else
                      "4096x16:0.35,16384x4:0.2,16384x4|32768x2|65536x1:0.45" if args.retrieval else
                      "4096x16:0.6,16384x4:0.25,32768x2:0.15")
    phases = parse_phases(args.phases or default_phases)
    max_train_bytes = args.max_train_bytes or ((2 << 20) if smoke else (256 << 20))
    steps_total = args.steps if args.steps is not None else (6 if smoke and args.time_budget is None else None)
    time_budget = args.time_budget if args.time_budget is not None else (525.0 if args.retrieval else 330.0)
    eval_windows = args.eval_windows or (4 if smoke else 64)
    amp = device.type == "cuda"  # bf16 autocast on the GPU; fp32 on CPU (bf16 matmuls are slow there)
    t_start = time.time()
    if args.evaluate is not None:
        return _evaluate_checkpoint(args, device, smoke, amp)
    with fused_attention_for_training(device):
        return _train(args, device, smoke, phases, max_train_bytes, steps_total, time_budget, eval_windows, amp,
                      t_start)


def _store_rows(final: Optional[dict], retrieval: Optional[dict]) -> list:
    """The record's numbers as rows for the benchmark's store: per context length, its losses and each task's
    retrieval (the flattened dicts become metrics such as ``passkey.exact``)."""
    rows = []
    for length, losses in (final or {}).items():
        rows.append({"section": "loss", "N": int(length), **losses})
    for length, tasks in (retrieval or {}).items():
        rows.append({"section": "retrieval", "N": int(length), **tasks})
    return rows


def _append_store(args, rows: list, **extra) -> None:
    """Append to the store next to the results (``--out-dir`` itself when it is not the checkpoints folder)."""
    import harness

    out_dir = None if Path(args.out_dir).resolve() == DEFAULT_CHECKPOINT.parent.resolve() else args.out_dir
    if out_dir is None and args.smoke:  # a smoke run leaves the store alone
        return
    harness.append_store("train_small_lm", rows, params=("N",), extra={"name": args.name, **extra}, out_dir=out_dir)


def _evaluate_checkpoint(args, device, smoke, amp) -> dict:
    """Dense retrieval accuracy of a saved checkpoint on more held-out instances than training's own evaluation
    (the same held-out text and seed space; 8-16 instances per task move a task's score by 6-12 points each)."""
    corpus = build_corpus(1 << 20)  # held-out text is complete at any training size
    model, ckpt = load_checkpoint(args.evaluate, device=device)
    lengths = [1024, 2048] if smoke else [16384, 32768, 65536]
    if args.families:
        instances = args.eval_instances or (1 if smoke else 8)
        result = evaluate_families(model, corpus.heldout, lengths, instances, args.seed + 9, amp, device)
    else:
        instances = args.eval_instances or 32
        result = evaluate_retrieval(model, corpus.heldout, lengths, {n: instances for n in lengths},
                                    args.seed + 9, amp, device)
    record = {"checkpoint": str(args.evaluate), "instances_per_task": instances, "seed": args.seed + 9,
              "model_args": ckpt["model_args"], "retrieval": result}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}_eval.json").write_text(json.dumps(record, indent=1) + "\n")
    _append_store(args, _store_rows(None, result), mode="evaluate", checkpoint=Path(args.evaluate).name,
                  instances_per_task=instances, seed=args.seed + 9)
    return record


def _train(args, device, smoke, phases, max_train_bytes, steps_total, time_budget, eval_windows, amp, t_start):
    torch.manual_seed(args.seed)
    corpus = build_corpus(max_train_bytes)
    train_stream = torch.frombuffer(bytearray(corpus.train), dtype=torch.uint8).to(device)
    held_stream = torch.frombuffer(bytearray(corpus.heldout), dtype=torch.uint8).to(device)

    mod = load_model_module()
    sizes = ((RETRIEVAL_SMOKE_MODEL if smoke else RETRIEVAL_MODEL) if args.retrieval else
             (SMOKE_MODEL if smoke else GPU_MODEL))
    overrides = {"n_layers": args.layers, "conv_width": args.conv_width,
                 "attn_temperature_floor": args.attn_temperature}
    sizes = dict(sizes, **{field: value for field, value in overrides.items() if value is not None})
    shapes = phase_shapes(phases)
    model_args = mod.ModelArgs(**sizes, max_seq_len=max(seq for seq, _ in shapes))
    model = mod.Transformer(model_args).to(device)
    n_params = param_count(model)
    print(f"model: {dataclasses.asdict(model_args)}; {n_params / 1e6:.2f} M parameters; device {device}")

    opts = make_optimizers(model, args, device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    import random

    import retrieval_tasks as rt

    host_rng = random.Random(args.seed)  # --retrieval: windows and instances are drawn on the host
    styles = tuple(args.styles or rt.STYLES)
    unknown = sorted(set(styles) - set(rt.STYLES))
    if unknown:
        raise SystemExit(f"--styles: unknown {unknown}; valid: {list(rt.STYLES)}")

    import retrieval_families as rf

    families = [f.name for f in rf.TRAIN_FAMILIES] if args.families else None
    if args.families and not args.retrieval:
        raise SystemExit("--families trains the retrieval model: give --retrieval too")

    def next_batch(seq, batch, generator):
        if args.retrieval:
            return _retrieval_batches(corpus.train, seq, batch, host_rng, args.task_share, device, styles,
                                      args.answer_weight, args.task_weights, args.extra_lookups,
                                      args.extra_list_share, args.extra_near_miss_share, families)
        return (*_batches(train_stream, seq, batch, generator), None)

    def train_loss(x, y, weight):
        """(loss to differentiate, loss to report: the plain mean next-byte loss)"""
        loss = _loss(model, x, y, amp, weight)
        return loss if weight is not None else (loss, loss)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # step allocation: a fixed count, or calibrated from forward+backward times (no optimizer step, so the
    # calibration leaves the weights untouched; it also warms up cuDNN/cuBLAS for each shape)
    step_times = {}  # (seq_len, batch) -> seconds per step
    if steps_total is None:
        calib_gen = torch.Generator(device=device).manual_seed(args.seed + 1)
        for seq, batch in shapes:
            times = []
            for i in range(7):
                x, y, weight = next_batch(seq, batch, calib_gen)
                sync()
                t = time.perf_counter()
                train_loss(x, y, weight)[0].backward()
                sync()
                times.append(time.perf_counter() - t)
                model.zero_grad(set_to_none=True)
            step_times[seq, batch] = median_after_warmup(times) * 1.03  # + 3%: an AdamW step
        if args.optimizer != "adamw":
            # other optimizers' steps (AdamW's part included, so it counts twice: ~1% of a step) are timed on a
            # copy, so the weights stay as they are
            extra = optimizer_step_seconds(model, args, device, sync)
            step_times = {shape: t + extra for shape, t in step_times.items()}
        # a mixed phase's steps cycle through its shapes: its mean step time is theirs
        phase_steps = [max(1, int(p.share * time_budget * len(p.shapes) / sum(step_times[x] for x in p.shapes)))
                       for p in phases]
    else:
        phase_steps = [max(1, round(p.share * steps_total)) for p in phases]
    if args.phase_steps is not None:  # after the calibration, whose batches come from the same host generator
        if len(args.phase_steps) != len(phases) or min(args.phase_steps) < 1:
            raise SystemExit(f"--phase-steps: {len(phases)} positive counts needed (one per phase), "
                             f"got {args.phase_steps}")
        phase_steps = list(args.phase_steps)
    total_steps = sum(phase_steps)
    print(f"phases (seq x batch: steps): {[(p.label, n) for p, n in zip(phases, phase_steps)]}; "
          f"calibrated step seconds { {f'{s}x{b}': round(t, 4) for (s, b), t in step_times.items()} }")

    log = []
    step = 0
    running = torch.zeros((), device=device)
    running_n = 0
    t_train = time.time()
    model.train()
    stopped_at = None
    for phase, n_steps in zip(phases, phase_steps):
        if stopped_at is not None:
            break
        for phase_step in range(n_steps):
            if args.max_seconds is not None and time.time() - t_train > args.max_seconds:
                stopped_at = step  # a hard wall-clock limit: keep what was trained, say where it stopped
                print(f"stopped at step {step}/{total_steps}: --max-seconds {args.max_seconds} reached", flush=True)
                break
            seq, batch = phase.shapes[phase_step % len(phase.shapes)]
            factor = lr_at(step, total_steps, 1.0, min(args.warmup, max(1, total_steps // 10)), 0.1)
            lr = args.lr * factor
            for opt in opts:
                for group in opt.param_groups:
                    group["lr"] = group["peak_lr"] * factor
            x, y, weight = next_batch(seq, batch, gen)
            objective, loss = train_loss(x, y, weight)
            objective.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for opt in opts:
                opt.step()
            model.zero_grad(set_to_none=True)
            running += loss.detach()
            running_n += 1
            step += 1
            if step % args.log_every == 0 or step == total_steps:
                value = float(running) / running_n  # one host sync per log line, not per step
                running.zero_()
                running_n = 0
                elapsed = time.time() - t_train
                log.append({"step": step, "seq_len": seq, "loss": round(value, 4),
                            "bpb": round(value / math.log(2), 4), "lr": lr, "seconds": round(elapsed, 1)})
                print(f"step {step:6d}/{total_steps} seq {seq:6d} loss {value:.4f} ({value / math.log(2):.3f} bpb) "
                      f"lr {lr:.2e} {elapsed:7.1f} s", flush=True)
    sync()
    train_seconds = time.time() - t_train

    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = out_dir / f"{args.name}.pt"
    save_checkpoint(model, ckpt_path, {"steps": step})  # the weights first: an evaluation cut short keeps them
    final = {}
    for seq, batch in sorted(dict(shapes).items()):  # one evaluation per context length
        final[str(seq)] = {
            "train_loss": round(evaluate_stream(model, train_stream, seq, batch, eval_windows, args.seed + 7, amp), 4),
            "heldout_loss": round(evaluate_stream(model, held_stream, seq, batch, eval_windows, args.seed + 8, amp), 4),
        }
        final[str(seq)]["train_bpb"] = round(final[str(seq)]["train_loss"] / math.log(2), 4)
        final[str(seq)]["heldout_bpb"] = round(final[str(seq)]["heldout_loss"] / math.log(2), 4)
    print(f"final loss (nats/byte) per context length: {json.dumps(final)}")
    retrieval = None
    if args.retrieval:
        lengths = sorted(dict(shapes)) if smoke else [16384, 32768, 65536]
        if families:
            retrieval = evaluate_families(model, corpus.heldout, lengths, args.eval_instances or (1 if smoke else 8),
                                          args.seed + 9, amp, device)
        else:
            per_task = {n: (args.eval_instances or (2 if smoke else 32)) for n in lengths}
            retrieval = evaluate_retrieval(model, corpus.heldout, lengths, per_task, args.seed + 9, amp, device,
                                           styles=("vkey",) + tuple(s for s in styles if s != "vkey"))

    phase_records = [_phase_record(p, n) for p, n in zip(phases, phase_steps)]
    record = {
        "checkpoint": ckpt_path.name,
        "model_args": dataclasses.asdict(model_args),
        "parameters": n_params,
        "training": {
            "seed": args.seed, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "python": platform.python_version(), "smoke": smoke,
            "precision": "bf16 autocast, fp32 master weights" if amp else "fp32",
            "optimizer": {"name": "AdamW" if args.optimizer == "adamw" else
                          "Muon (blocks' weight matrices, momentum 0.95, Nesterov) + AdamW (the rest)",
                          "muon_lr": args.muon_lr if args.optimizer == "muon" else None,
                          "lr": args.lr, "betas": [0.9, 0.95], "weight_decay": args.weight_decay,
                          "grad_clip": 1.0, "schedule": "linear warm-up then cosine to 0.1x",
                          "warmup_steps": min(args.warmup, max(1, total_steps // 10))},
            "phases": phase_records,
            "steps": total_steps,
            "tokens": sum(r["tokens"] for r in phase_records),
            "time_budget_s": None if args.steps is not None or args.phase_steps is not None else time_budget,
            "calibrated_step_seconds": {f"{s}x{b}": t for (s, b), t in step_times.items()},
            "train_seconds": round(train_seconds, 1),
            "stopped_at_step": stopped_at,
            "total_seconds": None,  # filled below
            "log": log,
        },
        "final": final,
        "retrieval": retrieval,
        "task_share": args.task_share if args.retrieval else None,
        "task_weights": args.task_weights if args.retrieval else None,
        "answer_weight": args.answer_weight if args.retrieval else None,
        "extra_lookups_per_64k": args.extra_lookups if args.retrieval else None,
        "extra_list_share": args.extra_list_share if args.retrieval else None,
        "extra_near_miss_share": args.extra_near_miss_share if args.retrieval else None,
        "styles": list(styles) if args.retrieval and not families else None,
        "families": families,
        "eval_windows": eval_windows,
        "manifest": corpus.manifest,
    }
    size = save_checkpoint(model, ckpt_path, {"final": final, "steps": total_steps, "retrieval": retrieval})
    record["checkpoint_bytes"] = size
    record["training"]["total_seconds"] = round(time.time() - t_start, 1)
    (out_dir / f"{args.name}.json").write_text(json.dumps(record, indent=1) + "\n")
    _append_store(args, _store_rows(final, retrieval) + [{"section": "training", "steps": total_steps,
                                                          "train_seconds": round(train_seconds, 1),
                                                          "checkpoint_bytes": size}],
                  mode="train", seed=args.seed)
    print(f"saved {ckpt_path} ({size / 1e6:.2f} MB) and {args.name}.json; train {train_seconds:.1f} s, "
          f"total {record['training']['total_seconds']} s")
    _plot_loss(record, out_dir / f"{args.name}_loss.png")
    return record


def _plot_loss(record: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no loss plot")
        return
    log = record["training"]["log"]
    if not log:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in log], [r["bpb"] for r in log], lw=1.2)
    for phase_end in _phase_ends(record):
        ax.axvline(phase_end, color="grey", lw=0.6, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (bits per byte)")
    labels = ["|".join(f"{x['seq_len'] // 1024}K" for x in p["shapes"]) for p in record["training"]["phases"]]
    ax.set_title(f"small byte-level LM on Python source (phases: {' / '.join(labels)} contexts)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _phase_record(phase: Phase, steps: int) -> dict:
    """A phase as the JSON records it; a plain phase keeps the earlier records' fields (seq_len, batch)."""
    counts = [steps // len(phase.shapes) + (i < steps % len(phase.shapes)) for i in range(len(phase.shapes))]
    record = {"shapes": [{"seq_len": s, "batch": b, "steps": c} for (s, b), c in zip(phase.shapes, counts)],
              "steps": steps, "tokens": sum(s * b * c for (s, b), c in zip(phase.shapes, counts))}
    if len(phase.shapes) == 1:
        record = {"seq_len": phase.shapes[0][0], "batch": phase.shapes[0][1], **record}
    return record


def _phase_ends(record: dict) -> list[int]:
    ends, acc = [], 0
    for p in record["training"]["phases"][:-1]:
        acc += p["steps"]
        ends.append(acc)
    return ends


if __name__ == "__main__":
    main()
