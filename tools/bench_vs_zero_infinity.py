"""Side by side with DeepSpeed ZeRO-Infinity: the same Megatron-Core GPT, the same drive.

    python tools/bench_vs_zero_infinity.py --dir /nvme/bench --json-out zi.json

For each M (micro-batches per step, ``--micro-batches``, default 1 4 16) it trains the same
GPTModel two ways, each in a child process of its own, alternating ``--rounds`` times:

* **ZeRO-Infinity**: ``deepspeed.initialize`` with ZeRO stage 3, parameters and optimizer
  state offloaded to ``nvme`` in ``--dir``; DeepSpeed's CPU AdamW and its libaio engine.
* **ours**: ``--snake-offload`` with weights, gradients and optimizer state on ``nvme`` in
  the same directory's file system.

Both start from the same initial weights (Megatron's initialisation under the same seed),
read the same mock-data micro-batches, and use the same micro-batch size, global batch,
precision (fp32), AdamW hyper-parameters (no weight decay on biases and norms, Megatron's
rule), constant learning rate and gradient clipping.

Per system and M it records the median step time after ``--warmup`` steps (tokens/s), the
peak RSS (the OS's VmHWM of the child), the bytes read and written per step (the child's
``/proc/<pid>/io``, read by this process at each step's end, so neither system counts
itself), the losses, and the host memory each holds beside the drive (DeepSpeed's swap
buffers; our host pool). The last line is **tokens/s ours / ZeRO-Infinity at the largest M**.

``--device cpu`` (the default) runs both on the CPU, DeepSpeed on its CPU accelerator;
``--device cuda`` runs both on the GPU, DeepSpeed on its CUDA accelerator (tools/gpu_check.sh
runs it there, with ``--bf16``: both in bf16 with fp32 master weights). DeepSpeed is an
optional extra (``bash tools/install.sh --bench``). On first use it compiles two ops: ``cpu_adam`` (about 1 to 1.5 minutes on 2
cores) and ``async_io`` (4 to 10 minutes); they are cached in ``$TORCH_EXTENSIONS_DIR``
(default ``~/.cache/torch_extensions``), so later runs start at once. Before the comparison the tool
picks DeepSpeed's aio block size and queue depth by timing its own aio handle on a file in
``--dir`` (``--aio`` skips that), as DeepSpeed's ``ds_nvme_tune`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) .*not installed.*")

MiB = 1 << 20
SYSTEMS = ("zero_infinity", "ours")
WORKERS = SYSTEMS + ("initial",)   # the children this script starts
# DeepSpeed's documented aio default first, then the queue depth and block size its
# tutorials also use. Not 4 MiB blocks: with them 0.19.8 fails at step 2 ("param N already
# assigned swap buffer id M") on this benchmark's smaller shapes.
AIO_CANDIDATES = [(1 * MiB, 8), (1 * MiB, 32), (256 << 10, 8), (256 << 10, 32)]


# --- the run both systems train ------------------------------------------------------------
def model_flags(a, m: int) -> list[str]:
    """pretrain_gpt.py's flags for the model, data and optimizer both systems use."""
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
            "--max-position-embeddings", str(a.seq), "--micro-batch-size", str(a.micro_batch),
            "--global-batch-size", str(a.micro_batch * m), "--tokenizer-type",
            "NullTokenizer", "--vocab-size", str(a.vocab), "--hidden-dropout", "0",
            "--attention-dropout", "0", "--lr", str(a.lr), "--lr-decay-style", "constant",
            "--weight-decay", "0.01", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--adam-eps", "1e-8", "--clip-grad", "1.0", "--mock-data", "--device", a.device,
            "--train-iters", str(a.warmup + a.steps), "--seed", "1234",
            *(["--bf16"] if a.bf16 else [])]


def ours_flags(a, m: int, offload_dir: str) -> list[str]:
    return model_flags(a, m) + [
        "--snake-offload", "--snake-offload-dir", offload_dir, "--snake-param-tier", "nvme",
        "--snake-optimizer-tier", "nvme", "--snake-host-memory-limit", a.host_memory_limit,
        *shlex.split(a.ours_flags)]


def _start(flags: list[str]):
    """pretrain_gpt's ``flags`` parsed, one rank started on their ``--device`` (Megatron's
    parallel state, seeded as a run seeds it): (args, device, padded vocabulary size)."""
    from megatron_snake.training import distributed
    from megatron_snake.training.arguments import parse_args
    from megatron_snake.training.tokenizer import (build_tokenizer, padded_vocab_size,
                                                   tokenizer_flags)
    args = parse_args(flags)
    device = distributed.resolve_device(args.device)
    distributed.initialize(device=device, seed=args.seed)
    vocab = padded_vocab_size(build_tokenizer(**tokenizer_flags(args)).vocab_size,
                              args.make_vocab_size_divisible_by, 1)
    return args, device, vocab


def _batches(args, vocab_size: int, device):
    """The run's mock-data micro-batches on ``device``, in the order pretrain_gpt reads
    them."""
    from megatron_snake.training.data import build_gpt_datasets, micro_batches, num_samples_for
    from megatron_snake.training.loop import to_device
    from megatron_snake.training.tokenizer import build_tokenizer, tokenizer_flags
    train, _, _ = build_gpt_datasets(
        mock=True, data_path=None, split=args.split, seq_length=args.seq_length,
        seed=args.seed, tokenizer=build_tokenizer(**tokenizer_flags(args)),
        data_cache_path=None, num_samples=num_samples_for(args.train_iters,
                                                          args.global_batch_size, 0, 0))
    return (to_device(mb, device) for mb in micro_batches(
        train, micro_batch_size=args.micro_batch_size, data_parallel_rank=0,
        data_parallel_size=1, consumed_samples=0))


def _device_memory(device) -> dict:
    """The device's peak allocated and reserved bytes since the start (GPU only)."""
    import torch
    if device.type != "cuda":
        return {}
    return {"device_peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "device_peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}


def _report(kind: str, payload: dict) -> None:
    print(f"@@{kind} {json.dumps(payload)}", flush=True)


# --- ZeRO-Infinity ---------------------------------------------------------------------------
def ds_config(args, a, numels: list[int], nvme_path: str) -> dict:
    """ZeRO-3 with parameters and optimizer state on nvme. Parameters of up to 1 MiB stay
    resident (``stage3_param_persistence_threshold``); DeepSpeed swaps each larger one
    through a pinned buffer of its own (fewer buffers than such parameters fails at step 1:
    "Not enough buffers"), so the buffers are as many as those parameters and as large as
    the largest."""
    threshold = MiB // 4   # 1 MiB of fp32
    swapped = [n for n in numels if n > threshold]   # DeepSpeed keeps numel <= it resident
    block, depth = a.aio
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.num_microbatches,
        "gradient_clipping": args.clip_grad,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
        # as ours: fp32, or with --bf16 bf16 weights and compute with fp32 master weights
        "bf16": {"enabled": bool(args.bf16)}, "fp16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {
            "lr": args.lr, "betas": [args.adam_beta1, args.adam_beta2], "eps": args.adam_eps,
            "weight_decay": args.weight_decay}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True,
                              "buffer_count": max(5, len(swapped)),
                              "buffer_size": max(swapped, default=threshold),
                              "max_in_cpu": 0},
            # DeepSpeed's defaults: with pipeline_read/write on, 0.19.8 fails at the first
            # step of a model of several optimizer sub-groups (an assertion in its
            # pipelined swapper); with one sub-group there is nothing to pipeline
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True,
                                  "buffer_count": 4, "pipeline_read": False,
                                  "pipeline_write": False},
            "stage3_param_persistence_threshold": threshold,
            "sub_group_size": int(1e8),
        },
        "aio": {"block_size": block, "queue_depth": depth, "intra_op_parallelism": 1,
                "single_submit": False, "overlap_events": True},
    }


def _megatron_param_groups(model) -> list[dict]:
    """Megatron's rule: biases and 1-D parameters (norms) get no weight decay."""
    from megatron_snake.optim.unit_params import no_weight_decay
    decay, plain = [], []
    for name, p in model.named_parameters():
        (plain if no_weight_decay(name, p) else decay).append(p)
    return [{"params": decay}, {"params": plain, "weight_decay": 0.0}]


def run_zero_infinity(a, m: int, nvme_path: str) -> None:
    import torch
    from megatron_snake.training import distributed
    from megatron_snake.training.calibration import synchronize
    from megatron_snake.training.model import build_gpt_model
    # DeepSpeed reads the launcher's environment: one rank, set by hand
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(distributed.free_port()))
    import deepspeed
    from megatron_snake.schedule.loss import masked_loss_sum
    args, device, vocab = _start(model_flags(a, m))
    # sizes for the swap buffers from a model built on the meta device (no memory)
    with torch.device("meta"):
        shapes = [p.numel() for p in build_gpt_model(args, vocab, torch.device("meta"))
                  .parameters()]
    config = ds_config(args, a, shapes, nvme_path)
    # as ZeRO-Infinity builds models larger than memory: each parameter goes to the drive
    # as it is made
    with deepspeed.zero.Init(config_dict_or_path=config, remote_device="nvme",
                             dtype=torch.bfloat16 if args.bf16 else torch.float32):
        model = build_gpt_model(args, vocab, device)
    # zero.Init initialises some weights differently from a plain build (a parent module's
    # init of a child's partitioned weight is lost): load the plain build's, one at a time,
    # before DeepSpeed copies them into its optimizer's master weights
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            p.data.copy_(torch.load(os.path.join(a.initial, name + ".pt"), weights_only=True))
    if model.share_embeddings_and_output_weights:
        # the output layer reads the embedding's weight outside the embedding's forward
        deepspeed.zero.register_external_parameter(model,
                                                   model.shared_embedding_or_output_weight())
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=_megatron_param_groups(model),
                                           config=config, dist_init_required=False)
    off = config["zero_optimization"]["offload_param"]
    _report("memory", {"host_buffers_bytes": off["buffer_count"] * off["buffer_size"] * 4,
                       "what": f"{off['buffer_count']} parameter swap buffers of "
                               f"{off['buffer_size']} fp32", "config": config})
    batches = _batches(args, vocab, device)
    for step in range(args.train_iters):
        mbs = [next(batches) for _ in range(m)]
        synchronize(device)
        start = time.perf_counter()
        losses = []
        for mb in mbs:
            per_token = engine(mb["tokens"], mb["position_ids"], mb["attention_mask"],
                               labels=mb["labels"])
            loss, tokens = masked_loss_sum(per_token, mb["loss_mask"])
            loss = loss / tokens.clamp(min=1)      # Megatron's per-micro-batch mean
            engine.backward(loss)
            engine.step()       # DeepSpeed steps at the accumulation boundary only
            losses.append(loss.item())
        synchronize(device)
        _report("step", {"step": step + 1, "seconds": time.perf_counter() - start,
                         "loss": statistics.fmean(losses), **_device_memory(device)})


def save_initial_weights(a, directory: str) -> None:
    """Megatron's initial weights for the run (a plain build under the run's seed, the
    values ours starts from), one file per parameter, for ZeRO-Infinity to load."""
    import torch
    from megatron_snake.training.model import build_gpt_model
    args, device, vocab = _start(model_flags(a, 1))
    for name, p in build_gpt_model(args, vocab, device).named_parameters():
        torch.save(p.detach(), os.path.join(directory, name + ".pt"))


# --- ours ------------------------------------------------------------------------------------
def run_ours(a, m: int, offload_dir: str) -> None:
    from megatron_snake.schedule.loss import report_losses
    from megatron_snake.training.build import build_run
    from megatron_snake.training.calibration import synchronize
    args, device, vocab = _start(ours_flags(a, m, offload_dir))
    with build_run(args, device, vocab, log=lambda line: None) as run:
        pool = run.tensor_store.pool
        _report("memory", {"host_buffers_bytes": pool.limit_bytes,
                           "what": f"the store's host pool (--snake-host-memory-limit "
                                   f"{a.host_memory_limit})"})
        batches = _batches(args, vocab, device)
        for step in range(args.train_iters):
            mbs = [next(batches) for _ in range(m)]
            synchronize(device)
            start = time.perf_counter()
            out = run.step(mbs)
            synchronize(device)
            _report("step", {"step": step + 1, "seconds": time.perf_counter() - start,
                             "loss": statistics.fmean(
                                 float(x) for x in report_losses(out.reports)),
                             "pool_peak_bytes": pool.peak_in_use * pool.buffer_bytes,
                             **_device_memory(device)})


# --- measuring a child -----------------------------------------------------------------------
def _proc_io(pid: int) -> dict:
    with open(f"/proc/{pid}/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}


def _proc_peak_rss(pid: int) -> int:
    """The process's own peak resident memory since its exec (VmHWM). wait4's ru_maxrss is
    not: exec records the peak of the address space it replaces, the launching parent's."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def measure(a, system: str, m: int) -> dict:
    """Train ``system`` in a child; its step times and losses from its reports, its bytes
    (/proc/<pid>/io) and peak RSS (VmHWM) read at each report."""
    work = tempfile.mkdtemp(prefix=f"{system}_", dir=a.dir)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", system, "--work", work,
           "--m", str(m), "--initial", a.initial, *a.child_argv]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    steps, memory, tail, last_io, reaped, peak = [], {}, [], None, False, 0
    try:
        for line in child.stdout:
            if line.startswith("@@step "):
                io = _proc_io(child.pid)
                step = json.loads(line[7:])
                if last_io is not None:
                    step["read_bytes"] = io["read_bytes"] - last_io["read_bytes"]
                    step["write_bytes"] = io["write_bytes"] - last_io["write_bytes"]
                last_io = io
                peak = max(peak, _proc_peak_rss(child.pid))
                steps.append(step)
                print(f"  {system:>13} M {m:>2} step {step['step']}: {step['seconds']:.2f} s, "
                      f"loss {step['loss']:.4f}", flush=True)
            elif line.startswith("@@memory "):
                memory = json.loads(line[9:])
                last_io = _proc_io(child.pid)    # after the build: steps count from here
            else:
                tail = (tail + [line.rstrip()])[-40:]
        child.returncode, reaped = child.wait(), True
    finally:   # a failed or interrupted run leaves no process and no offload files
        if not reaped:
            child.kill()
            child.wait()
        child.stdout.close()
        shutil.rmtree(work, ignore_errors=True)
    if child.returncode != 0:
        raise RuntimeError(f"{system} (M {m}) failed:\n" + "\n".join(tail))
    timed = steps[a.warmup:]
    tokens = a.micro_batch * m * a.seq
    median_s = statistics.median(s["seconds"] for s in timed)
    return {"system": system, "m": m, "steps": steps, "median_step_s": median_s,
            "tokens_per_s": tokens / median_s, "peak_rss_bytes": peak,
            "read_bytes_per_step": statistics.median(s["read_bytes"] for s in timed),
            "write_bytes_per_step": statistics.median(s["write_bytes"] for s in timed),
            "losses": [s["loss"] for s in steps], "memory": memory,
            "device_peak_allocated_bytes": max((s.get("device_peak_allocated_bytes", 0)
                                                for s in steps), default=0)}


# --- choosing DeepSpeed's aio settings -------------------------------------------------------
def tune_aio(directory: str, nbytes: int = 256 * MiB) -> tuple[list, list]:
    """DeepSpeed's aio handle writing and reading ``nbytes`` in ``directory`` for each
    (block size, queue depth) candidate, twice each in turn; the fastest by the sum of
    median write and read times."""
    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder
    aio = AsyncIOBuilder().load()
    data = torch.empty(nbytes, dtype=torch.uint8).random_()
    back = torch.empty_like(data)
    path = os.path.join(directory, "aio_tune.bin")
    times = {c: [] for c in AIO_CANDIDATES}
    try:
        for _ in range(2):
            for block, depth in AIO_CANDIDATES:
                handle = aio.aio_handle(block, depth, False, True, 1)
                start = time.perf_counter()
                handle.sync_pwrite(data, path)
                middle = time.perf_counter()
                handle.sync_pread(back, path)
                times[(block, depth)].append((middle - start, time.perf_counter() - middle))
                if not torch.equal(data, back):
                    raise RuntimeError(f"DeepSpeed's aio (block {block}, queue depth {depth}) "
                                       "read back different bytes")
                back.zero_()
    finally:
        if os.path.exists(path):
            os.unlink(path)
    rows = [{"block_size": b, "queue_depth": d,
             "write_GBps": nbytes / statistics.median(w for w, _ in t) / 1e9,
             "read_GBps": nbytes / statistics.median(r for _, r in t) / 1e9}
            for (b, d), t in times.items()]
    best = min(rows, key=lambda r: 1 / r["write_GBps"] + 1 / r["read_GBps"])
    return [best["block_size"], best["queue_depth"]], rows


# --- the comparison --------------------------------------------------------------------------
def _aio(text: str) -> list[int]:
    try:
        block, depth = (int(x) for x in text.split(","))
    except ValueError:
        block = depth = 0
    if block <= 0 or depth <= 0 or block % 4096:
        raise argparse.ArgumentTypeError("--aio takes BLOCK_BYTES,QUEUE_DEPTH, positive, the "
                                         "block a multiple of 4096, e.g. 1048576,8")
    return [block, depth]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="the drive's directory both offload into "
                   "(default: a temporary directory)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=1, help="runs of each, alternating")
    p.add_argument("--lr", type=float, default=1e-4, help="both: a constant learning rate")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="both compute here (DeepSpeed's accelerator follows)")
    p.add_argument("--bf16", action="store_true",
                   help="both in bf16 with fp32 master weights (default: fp32)")
    p.add_argument("--host-memory-limit", default="2GiB", help="ours: the host pool")
    p.add_argument("--ours-flags", default="", metavar="FLAGS",
                   help="ours: more pretrain_gpt.py flags, e.g. '--snake-checkpoint-interval "
                        "2' (default: the defaults users get)")
    p.add_argument("--aio", type=_aio, default=None, metavar="BLOCK,DEPTH",
                   help="DeepSpeed's aio block size and queue depth (default: tuned here)")
    p.add_argument("--json-out", default="bench_vs_zero_infinity.json")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--m", type=int, help=argparse.SUPPRESS)
    p.add_argument("--initial", help=argparse.SUPPRESS)
    return p


def _write_json(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def _child_argv(a) -> list[str]:
    """The flags a child needs to train the same run."""
    out = ["--layers", str(a.layers), "--hidden", str(a.hidden), "--heads", str(a.heads),
           "--seq", str(a.seq), "--micro-batch", str(a.micro_batch), "--vocab", str(a.vocab),
           "--steps", str(a.steps), "--warmup", str(a.warmup), "--lr", str(a.lr),
           "--device", a.device, *(["--bf16"] if a.bf16 else []),
           "--host-memory-limit", a.host_memory_limit, f"--ours-flags={a.ours_flags}"]
    return out + ["--aio", f"{a.aio[0]},{a.aio[1]}"] if a.aio else out


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    # DeepSpeed picks its accelerator when first imported; the children inherit the choice
    os.environ.setdefault("DS_ACCELERATOR", a.device)
    if a.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            sys.exit("--device cuda: no CUDA device here (use --device cpu)")
    if a.worker == "initial":
        save_initial_weights(a, a.work)
        return 0
    if a.worker:
        (run_ours if a.worker == "ours" else run_zero_infinity)(a, a.m, a.work)
        return 0
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        sys.exit("bench_vs_zero_infinity.py needs DeepSpeed: DS_ACCELERATOR=cpu pip install "
                 "--no-build-isolation --no-deps deepspeed==0.19.8 hjson msgpack ninja "
                 "py-cpuinfo pydantic psutil einops tqdm (torch installed first), and "
                 "apt-get install libaio-dev")
    if a.steps < 1 or a.warmup < 0 or a.rounds < 1:
        sys.exit("--steps and --rounds must be >= 1 and --warmup >= 0")
    made_dir = a.dir is None
    a.dir = a.dir or tempfile.mkdtemp(prefix="bench_zi_")
    os.makedirs(a.dir, exist_ok=True)
    from megatron_snake.training.arguments import parse_args
    for m in a.micro_batches:   # a bad flag fails here, not after the first runs
        parse_args(ours_flags(a, m, a.dir))
    print("> DeepSpeed's ops compile on first use (cpu_adam 1-1.5 min, async_io 4-10 min on "
          "2 cores), then load from $TORCH_EXTENSIONS_DIR", flush=True)
    report = {"machine": {"cpus": os.cpu_count(), "dir": a.dir, "device": a.device},
              "args": None,
              "aio_tuning": None, "summary": None, "runs": []}
    runs = report["runs"]
    a.initial = tempfile.mkdtemp(prefix="initial_weights_", dir=a.dir)
    try:
        if a.aio is None:
            a.aio, report["aio_tuning"] = tune_aio(a.dir)
            print(f"> DeepSpeed aio: block {a.aio[0]}, queue depth {a.aio[1]} (fastest of "
                  f"{len(report['aio_tuning'])} candidates on {a.dir})", flush=True)
        a.child_argv = _child_argv(a)
        report["args"] = {k: v for k, v in vars(a).items() if k not in ("child_argv", "initial")}
        subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "initial",
                        "--work", a.initial, *a.child_argv], check=True,
                        stdout=subprocess.DEVNULL)
        for m in a.micro_batches:
            for _ in range(a.rounds):   # who goes first alternates over the whole run
                order = SYSTEMS if len(runs) % 4 == 0 else SYSTEMS[::-1]
                for system in order:
                    runs.append(measure(a, system, m))
                    _write_json(a.json_out, report)   # a later failure keeps these
    finally:
        shutil.rmtree(a.dir if made_dir else a.initial, ignore_errors=True)
    summary = []
    for m in a.micro_batches:
        row = {"m": m}
        for system in SYSTEMS:
            mine = [r for r in runs if r["m"] == m and r["system"] == system]
            row[system] = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                "peak_rss_bytes": max(r["peak_rss_bytes"] for r in mine),
                "read_bytes_per_step": statistics.median(r["read_bytes_per_step"] for r in mine),
                "write_bytes_per_step": statistics.median(r["write_bytes_per_step"]
                                                          for r in mine),
                "host_buffers_bytes": mine[0]["memory"].get("host_buffers_bytes"),
                "device_peak_allocated_bytes": max(r["device_peak_allocated_bytes"]
                                                   for r in mine),
                "first_losses": mine[0]["losses"][:4]}
        row["ratio"] = row["ours"]["tokens_per_s"] / row["zero_infinity"]["tokens_per_s"]
        summary.append(row)
        z, o = row["zero_infinity"], row["ours"]
        print(f"M {m:>2}: tokens/s ZeRO-Infinity {z['tokens_per_s']:.1f}, ours "
              f"{o['tokens_per_s']:.1f} ({row['ratio']:.2f}x); per step read/written GB "
              f"{z['read_bytes_per_step'] / 1e9:.2f}/{z['write_bytes_per_step'] / 1e9:.2f} vs "
              f"{o['read_bytes_per_step'] / 1e9:.2f}/{o['write_bytes_per_step'] / 1e9:.2f}; "
              f"peak RSS GiB {z['peak_rss_bytes'] / 2**30:.2f} vs "
              f"{o['peak_rss_bytes'] / 2**30:.2f}; first losses {z['first_losses']} vs "
              f"{o['first_losses']}", flush=True)
    report["summary"] = summary
    _write_json(a.json_out, report)
    last = summary[-1]
    print(f"tokens/s ours / ZeRO-Infinity at M {last['m']}: {last['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
