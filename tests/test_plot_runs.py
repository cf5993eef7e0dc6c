"""plot_runs.py: the series it reads from a log (a resumed run's, a half-written last line, a midtraining
run's), the table's figures, the flags two runs differ in, the PNG, and its one error line without
matplotlib."""

import json
import subprocess
import sys

import pytest

import plot_runs
from conftest import REPO, read_log


def write_log(path, records, tail=""):
    path.mkdir(parents=True, exist_ok=True)
    (path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return str(path)


def train(step, loss, tokens_per_step=100, **more):
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens": (step + 1) * tokens_per_step,
            "ms": 30_000.0, "tok_per_s": 200.0 + step, **more}


def series_steps(series):
    return {metric: sorted(by_step) for metric, by_step in series.items()}


def test_a_resumed_run_keeps_only_what_its_checkpoint_saw(tmp_path):
    # Killed at step 12, resumed from its checkpoint at step 5 and still running at step 9: the trainers cut
    # the log's records from step 5 on, and a log that kept them (the resumed steps follow them) reads the
    # same.
    before = [{"step": 0, "val_loss": 11.0}, *[train(s, 10.0 - s) for s in range(5)],
              {"step": 5, "val_loss": 6.0}]
    killed = [*[train(s, 5.0) for s in range(5, 10)], {"step": 10, "val_loss": 5.0}, train(10, 4.0),
              train(11, 4.0)]
    resumed = [{"step": 5, "val_loss": 5.5}] + [train(s, 9.0 - s / 2) for s in range(5, 10)]
    for name, records in [("cut", before[:-1] + resumed), ("kept", before + killed + resumed)]:
        run = plot_runs.read_run(write_log(tmp_path / name, records))
        assert series_steps(run["series"]) == {"loss": list(range(10)), "val_loss": [0, 5],
                                               "hellaswag_acc_norm": []}
        assert plot_runs.tokens_at(run, "loss")[5:] == [(600, 6.5), (700, 6.0), (800, 5.5), (900, 5.0),
                                                        (1000, 4.5)]
        assert plot_runs.tokens_at(run, "val_loss") == [(0, 11.0), (500, 5.5)]


def test_a_half_written_last_line_and_unknown_records_are_passed_over(tmp_path):
    flags = {"lr": 3e-3, "seed": 1, "data_dir": "data/demo"}
    records = [{"flags": flags, "time": 1e9}, {"step": 0, "val_loss": 11.0, "val_bpb": 3.0, "time": 1e9 + 1},
               train(0, 10.0, time=1e9 + 2), train(1, 9.0, time=1e9 + 122.5), "a string", {"step": "x"}]
    run = plot_runs.read_run(write_log(tmp_path / "run", records, tail='{"step": 2, "loss": 8.'))
    assert series_steps(run["series"]) == {"loss": [0, 1], "val_loss": [0], "hellaswag_acc_norm": []}
    assert run["flags"] == flags
    # the wall time from the records' clock: the first record to the last
    assert plot_runs.run_figures(run)[5] == "2.0 min"


def test_a_midtraining_runs_val_points_sit_at_the_tokens_seen_before_their_step(tmp_path):
    # mid_train.py's val records carry no token count: an eval at step s has seen s steps of total_batch_size
    records = [{"step": 0, "val_loss": 7.5}, train(0, 7.6, 4096), train(1, 7.0, 4096), train(2, 6.5, 4096),
               {"step": 3, "val_loss": 6.0}]
    run = plot_runs.read_run(write_log(tmp_path / "mid", records))
    assert plot_runs.tokens_at(run, "val_loss") == [(0, 7.5), (3 * 4096, 6.0)]
    assert plot_runs.tokens_at(run, "loss") == [(4096, 7.6), (8192, 7.0), (12288, 6.5)]


def test_val_points_follow_a_change_of_batch_size_on_resume(tmp_path):
    # 100 tokens a step up to step 5, then resumed with --total_batch_size 300, logged every 2 steps: each eval
    # sits at the tokens seen before its step, read off the train records around it; a val record's own
    # tokens where it has them
    records = [{"step": 0, "val_loss": 11.0}, *[train(s, 10.0 - s) for s in range(5)], {"step": 5, "val_loss": 6.0},
               *[{**train(s, 5.0), "tokens": 500 + (s - 4) * 300} for s in (5, 7, 9)],
               {"step": 8, "val_loss": 5.0}, {"step": 10, "val_loss": 4.0}, {"step": 11, "val_loss": 3.9},
               {"step": 12, "val_loss": 3.8, "tokens": 2345}]
    run_dir = write_log(tmp_path / "run", records)
    run = plot_runs.read_run(run_dir)
    assert plot_runs.tokens_at(run, "val_loss") == [(0, 11.0), (500, 6.0), (1400, 5.0), (2000, 4.0), (2300, 3.9),
                                                    (2345, 3.8)]
    plot_runs.main([run_dir, "--out", str(tmp_path / "run.png")])
    assert (tmp_path / "run.png").stat().st_size > 0


def test_the_table_and_the_flags_that_differ(tmp_path, capsys):
    log_a = [{"flags": {"lr": 3e-3, "seed": 1, "out_dir": "a"}}, {"step": 0, "val_loss": 11.0},
             train(0, 10.0, mfu=0.30), {"step": 1, "val_loss": 9.0}, {"step": 1, "hellaswag_acc_norm": 0.25},
             train(1, 9.5, mfu=0.40), train(3, 9.0, mfu=0.50), {"step": 4, "val_loss": 9.5}]
    log_b = [{"flags": {"lr": 1e-3, "seed": 2, "out_dir": "b"}}, train(0, 10.0)]
    runs = [plot_runs.read_run(write_log(tmp_path / n, log)) for n, log in (("a", log_a), ("b", log_b))]
    # last and best val, HellaSwag, tokens, the step times summed (step 3 stands for steps 2 and 3), median
    # tok/s (of 200, 201, 203) and MFU
    figures = ["9.5000", "9.0000", "0.2500", "400", "~2.0 min", "201", "40.0%"]
    assert plot_runs.run_figures(runs[0])[1:] == figures
    assert plot_runs.run_figures(runs[1])[1:] == ["-", "-", "-", "100", "~0.5 min", "200", "-"]
    plot_runs.print_differences(runs)
    out = capsys.readouterr().out.splitlines()
    assert out[1:3] == ["flags that differ", f"flag  {tmp_path / 'a'}  {tmp_path / 'b'}"]
    assert out[3].split() == ["lr", "0.003", "0.001"] and out[4].split() == ["seed", "1", "2"]
    assert out[5].startswith("note: the runs read different data or seeds (seed)")


def test_gpt2_val_loss_compares_only_on_fineweb_edu_at_1024_tokens(tmp_path):
    fineweb = tmp_path / "fw"
    fineweb.mkdir()
    (fineweb / "manifest.json").write_text(json.dumps({"source": plot_runs.FINEWEB_EDU_SOURCE}))
    assert plot_runs.gpt2_val_applies({"data_dir": str(fineweb), "seq_len": 1024})
    assert not plot_runs.gpt2_val_applies({"data_dir": str(fineweb), "seq_len": 256})
    assert not plot_runs.gpt2_val_applies({"data_dir": f"{REPO}/data/demo", "seq_len": 1024})
    # the data on another machine: prepare_fineweb.py's default folder name
    assert plot_runs.gpt2_val_applies({"data_dir": "/elsewhere/fineweb-edu-10BT", "seq_len": 1024})
    assert not plot_runs.gpt2_val_applies({"data": ["chat:hub"], "seq_len": 1024})  # a midtraining run
    assert not plot_runs.gpt2_val_applies({})


def test_a_real_run_and_a_synthetic_one_in_one_png(base_ckpt, tmp_path):
    matplotlib_image = pytest.importorskip("matplotlib.image")
    other = write_log(tmp_path / "other", [{"flags": {"lr": 1e-3}}, train(0, 10.0),
                                           {"step": 1, "hellaswag_acc_norm": 0.26}])
    png = tmp_path / "runs.png"
    proc = subprocess.run([sys.executable, f"{REPO}/plot_runs.py", base_ckpt, other, "--out", png],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # the real run's row: its last val loss, 30 steps of 256 tokens; its flags from its checkpoint
    last_val = [r["val_loss"] for r in read_log(base_ckpt) if "val_loss" in r][-1]
    row = next(line for line in proc.stdout.splitlines() if line.startswith(base_ckpt)).split()
    assert row[1] == f"{last_val:.4f}" and row[4] == "7,680", proc.stdout
    lr_rows = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("lr ")]
    assert lr_rows == [["0.003", "0.001"]], proc.stdout
    # loss and HellaSwag side by side: 12 x 4.5 inches at 80 dpi
    assert matplotlib_image.imread(png).shape == (360, 960, 4)


def test_a_metric_added_to_the_step_gets_a_panel_of_its_own(tmp_path, capsys):
    matplotlib_image = pytest.importorskip("matplotlib.image")
    # a run whose train_step adds max_logit (docs/forking.md's example) and aux_loss, from step 2 on
    records = [{"step": 0, "val_loss": 11.0}, train(0, 10.0, max_logit=4.5), train(1, 9.0, max_logit=5.0),
               train(2, 8.0, max_logit=5.5, aux_loss=0.1, note="not a number: no panel")]
    run = plot_runs.read_run(write_log(tmp_path / "run", records))
    assert plot_runs.tokens_at(run, "max_logit") == [(100, 4.5), (200, 5.0), (300, 5.5)]
    assert plot_runs.tokens_at(run, "aux_loss") == [(300, 0.1)]
    plot_runs.main([str(tmp_path / "run"), "--out", str(tmp_path / "run.png")])
    # the loss, then aux_loss and max_logit beside it: 17 x 4.5 inches at 80 dpi
    assert matplotlib_image.imread(tmp_path / "run.png").shape == (360, 1360, 4)
    # with HellaSwag too, four panels: two rows of three
    write_log(tmp_path / "run", records + [{"step": 3, "hellaswag_acc_norm": 0.26}])
    plot_runs.main([str(tmp_path / "run"), "--out", str(tmp_path / "run.png")])
    assert matplotlib_image.imread(tmp_path / "run.png").shape == (720, 1360, 4)


def test_without_matplotlib_the_table_then_one_line_and_no_failure(tmp_path):
    run_dir = write_log(tmp_path / "run", [train(0, 10.0)])
    # an import of matplotlib fails as where it is not installed
    code = (f"import sys, runpy; sys.modules['matplotlib'] = None; "
            f"sys.argv = ['plot_runs.py', {run_dir!r}]; runpy.run_path({REPO + '/plot_runs.py'!r}, "
            f"run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and run_dir in proc.stdout and "wrote" not in proc.stdout  # a table-only use
    assert proc.stderr.splitlines() == ["no picture: runs.png needs matplotlib, which is not installed (pip install "
                                        "matplotlib)"]


@pytest.mark.parametrize("argv,expect", [(["{tmp}/none"], "cannot read {tmp}/none/log.jsonl"),
                                         (["{tmp}", "--smooth", "1"], "--smooth 1.0: give a weight"),
                                         (["{tmp}", "--out", "{tmp}/no/such/dir.png"], "cannot write"),
                                         (["{tmp}", "{tmp}/garbled"], "{tmp}/garbled/log.jsonl holds no loss record"),
                                         (["{tmp}", "--out", "{tmp}/x.txt"], "--out {tmp}/x.txt: the picture is a PNG"),
                                         (["{tmp}", "--out", "{tmp}/runs"], "--out {tmp}/runs: the picture is a PNG"),
                                         (["{tmp}/tokens"], "{tmp}/tokens/log.jsonl:2: its tokens is '1.2M', not a"),
                                         (["{tmp}/tok_per_s"], "{tmp}/tok_per_s/log.jsonl:1: its tok_per_s is None")])
def test_bad_input_is_one_error_line(argv, expect, tmp_path, capsys):
    write_log(tmp_path, [train(0, 10.0)])
    write_log(tmp_path / "tokens", [train(0, 10.0), train(1, 9.0, tokens="1.2M")])
    write_log(tmp_path / "tok_per_s", [train(0, 10.0, tok_per_s=None)])
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "log.jsonl").write_bytes(bytes(range(256)) * 8)  # not a log: no record in it
    with pytest.raises(SystemExit) as exit_info:
        plot_runs.main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err.splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert expect.format(tmp=tmp_path) in err[0]
