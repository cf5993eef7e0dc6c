"""
Loss curves of training runs from their log.jsonl, one PNG, and a table of each run's figures.

One run:        python plot_runs.py out/demo                       # writes runs.png
Compare runs:   python plot_runs.py out/base out/variant --out compare.png

A run is the --out_dir of train_gpt2.py or mid_train.py, still running or done, resumed or not. For two
runs or more the table is followed by the flags in which they differ. Works offline and without a display;
the picture needs matplotlib (pip install matplotlib), the table only Python: without matplotlib the
table is printed, a line says there is no picture, and the exit code is 0.
"""

import argparse
import glob
import json
import os
import statistics
import sys

# OpenAI's GPT-2 124M as build-nanogpt compares its runs with it. Val loss 3.2924 on FineWeb-Edu
# sample-10BT's val shard: build-nanogpt's play.ipynb (loss_baseline). HellaSwag acc_norm 0.2955, completion
# style on the 10,042 val examples as hellaswag.py scores them: build-nanogpt's hellaswag.py docstring (its
# notebook draws 0.2945).
GPT2_VAL_LOSS = 3.2924
GPT2_HELLASWAG = 0.2955
# what prepare_fineweb.py writes into its manifest.json for its default data, FineWeb-Edu sample-10BT
FINEWEB_EDU_SOURCE = "hub: HuggingFaceFW/fineweb-edu sample-10BT"
METRICS = ("loss", "val_loss", "hellaswag_acc_norm")
# the other fields of a record that the table and the picture compute with
NUMBERS = ("tokens", "ms", "tok_per_s", "mfu")
# The fields of the trainers' step records, drawn as the loss or given in the table or not a measure of training.
# Any other number in a step record is a metric added to the step (in train_step): it gets a panel of its own.
STEP_FIELDS = ("step", "loss", "last_loss", "lr", "muon_lr", "grad_norm", "last_grad_norm", "tokens", "train_seconds",
               "epoch", "ms", "data_ms", "forward_backward_ms", "optimizer_ms", "sync_ms", "tok_per_s", "mfu",
               "peak_mem_gib", "eta_s", "time")
# flags in which two runs of one experiment differ anyway
NOT_COMPARED = ("out_dir", "resume", "resume_checkpoint", "run", "dry_run")
DATA_FLAGS = ("data_dir", "data", "val_fraction", "seed")  # flags that change what a run reads


def die(message):
    """Bad input or a run-time fault: one line naming the problem and the fix, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def get_args(argv=None):
    p = argparse.ArgumentParser(description="Loss curves (PNG) and a table of runs, from their log.jsonl.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.error = die
    p.add_argument("runs", nargs="+", help="run folders: the --out_dir of train_gpt2.py or mid_train.py")
    p.add_argument("--out", default="runs.png", help="the PNG to write (its name ends in .png)")
    p.add_argument("--smooth", type=float, default=0.8,
                   help="weight of the train loss's running mean, 0 to 1 (0: none), as TensorBoard's slider")
    args = p.parse_args(argv)
    if not 0 <= args.smooth < 1:
        die(f"--smooth {args.smooth}: give a weight from 0 up to (not including) 1")
    if not args.out.lower().endswith(".png"):  # matplotlib would write another format, or add .png to the name
        die(f"--out {args.out}: the picture is a PNG; give a file name ending in .png")
    return args


def main(argv=None):
    args = get_args(argv)
    runs = [read_run(os.path.normpath(run_dir)) for run_dir in args.runs]
    print_table(runs)
    if len(runs) > 1:
        print_differences(runs)
    plot(runs, args.out, args.smooth)


# -----------------------------------------------------------------------------
# reading a run


def read_run(run_dir):
    """A run's name, its series ({metric: {step: record}}) and its flags."""
    path = os.path.join(run_dir, "log.jsonl")
    try:
        with open(path, "rb") as f:
            series, flags = read_log(f)
    except OSError as e:
        die(f"cannot read {path} ({e.strerror}); give the --out_dir of a train_gpt2.py or mid_train.py run")
    except ValueError as e:  # a record of the log's own kind with a field that is not a number
        die(f"{path}:{e}; fix or remove that line")
    if not any(series.values()):
        die(f"{path} holds no loss record; give the --out_dir of a train_gpt2.py or mid_train.py run that has "
            f"trained a step")
    return dict(name=run_dir, series=series, flags=flags or checkpoint_flags(run_dir))


def read_log(lines):
    """The records of a log.jsonl by metric, {metric: {step: record}} (METRICS, then any metric added to the
    step records), and the run's flags where a record holds them (else None). The records of a resumed run
    that are past its checkpoint are dropped. A record whose tokens, ms, tok_per_s or mfu is not a number is
    a ValueError naming its line."""
    series = {metric: {} for metric in METRICS}
    flags, last_step = None, -1
    for line_no, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:  # a half-written line: the run is writing it, or was killed as it did
            continue
        if not isinstance(record, dict):
            continue
        for key in NUMBERS:
            if key in record and not isinstance(record[key], (int, float)):
                raise ValueError(f"{line_no}: its {key} is {record[key]!r}, not a number")
        for key in ("flags", "args"):
            if isinstance(record.get(key), dict):
                flags = record[key]
        step = record.get("step")
        if not isinstance(step, int):
            continue
        # A step lower than the one before: the run was resumed from its checkpoint at that step and did
        # the steps after it again. The trainers cut those records on resume; a log that kept them reads the
        # same.
        if step < last_step:
            for by_step in series.values():
                for dropped in [s for s in by_step if s >= step]:
                    del by_step[dropped]
        last_step = step
        for metric in METRICS:
            if isinstance(record.get(metric), (int, float)):
                series[metric][step] = record
        if step in series["loss"]:
            for metric, value in record.items():
                if metric not in STEP_FIELDS and isinstance(value, (int, float)):
                    series.setdefault(metric, {})[step] = record
    return series, flags


def checkpoint_flags(run_dir):
    """The flags in the run's newest readable checkpoint, for a log that does not hold them; {} if none."""
    for path in sorted(glob.glob(os.path.join(run_dir, "ckpt_*.pt")), reverse=True):
        try:
            import torch
            # mmap: the weights are not read, only the flags beside them
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)["args"]
        except Exception:  # torch missing, a checkpoint being written or damaged: try the one before it
            continue
    return {}


def tokens_at(run, metric):
    """The (tokens seen, value) points of a metric, at a record's own tokens where it has them. A train
    record counts its own step's tokens; an eval at step s comes before step s trains, so it has seen s
    steps' tokens: read off the train records around it, which count them step by step (the steps' size may
    change, with --total_batch_size on resume), linearly between two, and past the last at its rate."""
    # (steps trained, tokens seen) after each logged train step
    seen = [(0, 0)] + [(s + 1, r["tokens"]) for s, r in sorted(run["series"]["loss"].items()) if "tokens" in r]
    spans = list(zip(seen, seen[1:])) or [((0, 0), (1, 0))]

    def tokens_before(step):
        (s0, t0), (s1, t1) = next((span for span in spans if step <= span[1][0]), spans[-1])
        return t0 + (step - s0) * (t1 - t0) / (s1 - s0)
    points = sorted(run["series"].get(metric, {}).items())  # a metric another run logs may be missing
    return [(r["tokens"] if "tokens" in r else tokens_before(step), r[metric]) for step, r in points]


# -----------------------------------------------------------------------------
# the table


def run_figures(run):
    """A run's figures for the table, as strings."""
    train = sorted(run["series"]["loss"].items())
    val = [v for _, v in tokens_at(run, "val_loss")]
    hellaswag = [v for _, v in tokens_at(run, "hellaswag_acc_norm")]
    tok_per_s = [r["tok_per_s"] for _, r in train if "tok_per_s" in r]
    mfu = [r["mfu"] for _, r in train if "mfu" in r]
    # The wall time from the records' clock where they have one; else the time the logged steps took, each
    # standing for the steps since the one logged before it (evals left out): marked ~.
    times = [r["time"] for by_step in run["series"].values() for r in by_step.values()
             if isinstance(r.get("time"), (int, float))]
    if times:
        wall_time = f"{(max(times) - min(times)) / 60:.1f} min"
    else:
        steps = [s for s, _ in train]
        seconds = sum(r.get("ms", 0) / 1000 * (s - prev) for (s, r), prev in zip(train, [-1] + steps))
        wall_time = f"~{seconds / 60:.1f} min" if train else "-"
    return [run["name"], f"{val[-1]:.4f}" if val else "-", f"{min(val):.4f}" if val else "-",
            f"{hellaswag[-1]:.4f}" if hellaswag else "-",
            f"{train[-1][1].get('tokens', 0):,}" if train else "-",
            wall_time, f"{statistics.median(tok_per_s):,.0f}" if tok_per_s else "-",
            f"{statistics.median(mfu) * 100:.1f}%" if mfu else "-"]


def print_table(runs):
    header = ["run", "last val", "best val", "HellaSwag", "tokens", "wall time", "tok/s", "MFU"]
    rows = [run_figures(run) for run in runs]
    print_rows([header] + rows)
    if any(row[5].startswith("~") for row in rows):
        print("~: the steps' own times added up (the log has no clock times; evals are left out)")
    print("tok/s and MFU: the medians over the logged steps")


def print_differences(runs):
    """The flags in which the runs differ, a row each, and a note where they read different data or seeds."""
    for run in runs:
        if not run["flags"]:
            print(f"{run['name']}: no flags in its log.jsonl, nor a checkpoint to read them from")
    known = [run for run in runs if run["flags"]]
    if len(known) < 2:
        return
    names = sorted({name for run in known for name in run["flags"]} - set(NOT_COMPARED))
    differing = [name for name in names if len({repr(run["flags"].get(name)) for run in known}) > 1]
    if not differing:
        print("the runs' flags are the same (but --out_dir)")
        return
    print("\nflags that differ")
    print_rows([["flag"] + [run["name"] for run in known]] +
               [[name] + [str(run["flags"].get(name, "-")) for run in known] for name in differing])
    data_differs = [name for name in differing if name in DATA_FLAGS]
    if data_differs:
        print(f"note: the runs read different data or seeds ({', '.join(data_differs)}): their losses "
              f"differ by that too, not by the other flags alone")


def print_rows(rows):
    """Rows of strings as columns, the first left-aligned, the rest right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        print("  ".join(cells))


# -----------------------------------------------------------------------------
# the picture


def gpt2_val_applies(flags):
    """Whether GPT-2 124M's val loss compares with the run's: a pretraining run whose val shard is
    FineWeb-Edu sample-10BT's in GPT-2's tokens (prepare_fineweb.py's only tokenizer), by the data's
    manifest.json (where the data is not on this machine, by prepare_fineweb.py's default folder name),
    read in GPT-2's context of 1024 tokens."""
    data_dir = flags.get("data_dir")
    if not data_dir or flags.get("seq_len") != 1024:
        return False
    try:
        with open(os.path.join(data_dir, "manifest.json")) as f:
            return json.load(f).get("source") == FINEWEB_EDU_SOURCE
    except (OSError, ValueError, AttributeError):
        return os.path.basename(os.path.normpath(data_dir)) == "fineweb-edu-10BT"


def smoothed(values, weight):
    """TensorBoard's running mean: an exponential moving average, debiased at the start."""
    mean, out = 0.0, []
    for i, value in enumerate(values, 1):
        mean = weight * mean + (1 - weight) * value
        out.append(mean / (1 - weight**i))
    return out


def plot(runs, out, smooth):
    """The train (smoothed; raw, faint) and val loss of each run against tokens seen, in a colour of its own;
    HellaSwag beside them where a run logged it, then a panel for each metric added to the step, three panels
    a row; GPT-2 124M's figures where they compare."""
    try:
        import matplotlib
    except ImportError:  # the table alone is what a run without matplotlib asked for: no failure, a line
        print(f"no picture: {out} needs matplotlib, which is not installed (pip install matplotlib)", file=sys.stderr)
        return
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, FormatStrFormatter

    with_hellaswag = any(run["series"]["hellaswag_acc_norm"] for run in runs)
    added = sorted({metric for run in runs for metric in run["series"]} - set(METRICS))
    panels = ["loss"] + ["hellaswag_acc_norm"] * with_hellaswag + added
    columns = min(len(panels), 3)
    rows = -(-len(panels) // columns)
    fig, grid = plt.subplots(rows, columns, figsize=(7 + 5 * (columns - 1), 4.5 * rows), squeeze=False)
    axes = dict(zip(panels, grid.flat))
    for ax in grid.flat[len(panels):]:
        ax.set_visible(False)
    loss_ax = axes["loss"]
    for i, run in enumerate(runs):
        color = f"C{i}"
        if train := tokens_at(run, "loss"):
            tokens, losses = zip(*train)
            loss_ax.plot(tokens, losses, color=color, alpha=0.2, linewidth=0.8)
            loss_ax.plot(tokens, smoothed(losses, smooth), color=color, label=f"{run['name']} train")
        if val := tokens_at(run, "val_loss"):
            loss_ax.plot(*zip(*val), "o--", color=color, markersize=4, label=f"{run['name']} val")
        if hellaswag := tokens_at(run, "hellaswag_acc_norm"):
            axes["hellaswag_acc_norm"].plot(*zip(*hellaswag), "o-", color=color, markersize=4, label=run["name"])
        for metric in added:
            if points := tokens_at(run, metric):
                axes[metric].plot(*zip(*points), "o-", color=color, markersize=2, label=run["name"])
    if any(gpt2_val_applies(run["flags"]) for run in runs):
        loss_ax.axhline(GPT2_VAL_LOSS, color="gray", linestyle=":",
                        label=f"OpenAI GPT-2 124M val {GPT2_VAL_LOSS}")
    # a log scale, as build-nanogpt's: the late, small gains stay visible beside the early drop
    loss_ax.set(yscale="log", title="loss", xlabel="tokens", ylabel="loss (nats per token)")
    for axis_formatter in (loss_ax.yaxis.set_major_formatter, loss_ax.yaxis.set_minor_formatter):
        axis_formatter(FormatStrFormatter("%g"))
    if with_hellaswag:
        axes["hellaswag_acc_norm"].axhline(GPT2_HELLASWAG, color="gray", linestyle=":",
                                           label=f"OpenAI GPT-2 124M {GPT2_HELLASWAG}")
        axes["hellaswag_acc_norm"].set(title="HellaSwag", xlabel="tokens", ylabel="acc_norm")
    for metric in added:
        axes[metric].set(title=metric, xlabel="tokens")
    for ax in axes.values():
        ax.xaxis.set_major_formatter(EngFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=80)
    except OSError as e:
        die(f"cannot write {out} ({e.strerror}); give another --out")
    plt.close(fig)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
