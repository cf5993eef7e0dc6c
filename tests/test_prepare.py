import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, run, stdlib_files
from train_gpt2 import EOT_TOKEN, get_tokenizer, load_shard


def read_shards(out_dir):
    files = sorted(glob.glob(os.path.join(out_dir, "*.bin")), key=lambda f: f.rsplit("_", 1)[1])
    return files, [np.array(load_shard(f)) for f in files]


def expected_stream(docs):
    enc = get_tokenizer()
    return np.concatenate([[EOT_TOKEN] + enc.encode_ordinary(d) for d in docs]).astype(np.uint16)


def documents():
    """Real text: paragraphs of the stdlib's own docstrings and comments, with unicode mixed in."""
    text = open(stdlib_files(1, start=10)[0]).read() + "\nnaïve café — ünïcödé ✓ 日本語\n"
    return [p for p in text.split("\n\n") if p.strip()][:200]


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_shards_hold_the_documents_tokens(kind, tmp_path):
    docs = documents()
    src = tmp_path / "src"
    src.mkdir()
    if kind == "txt":
        for i, d in enumerate(docs):
            (src / f"doc{i:04d}.txt").write_text(d)
        inputs = [str(src / "**")]  # recursive: it matches src/ too, which is not a file and is left out
    elif kind == "jsonl":
        with open(src / "a.jsonl", "w") as f:
            f.writelines(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs[:120]))
        with open(src / "b.jsonl", "w") as f:
            f.writelines(json.dumps({"body": d}) + "\n" for d in docs[120:])
        inputs = [str(src / "a.jsonl"), str(src / "b.jsonl")]
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"body": docs}), src / "docs.parquet", row_group_size=50)
        inputs = [str(src / "docs.parquet")]
    field = [] if kind == "txt" else ["--text_field", "body"]
    out = tmp_path / "out"
    proc = run("prepare_fineweb.py", "--input", *inputs, *field, "--out_dir", out, "--shard_size", 3000,
               "--workers", 2, check=True)
    files, shards = read_shards(out)
    stream = expected_stream(docs)
    assert np.array_equal(np.concatenate(shards), stream)
    assert all(len(s) == 3000 for s in shards[:-1]) and 0 < len(shards[-1]) <= 3000
    assert "_val_000000" in files[0] and all("_train_" in f for f in files[1:])
    manifest = json.load(open(out / "manifest.json"))
    assert manifest["shards"][-1]["end_doc"] == len(docs) and manifest["complete"]
    assert [s["tokens"] for s in manifest["shards"]] == [len(s) for s in shards]
    assert f"{len(docs):,} documents" in proc.stdout


def test_second_run_skips_and_stopped_runs_restart_to_the_same_shards(tmp_path):
    inputs = stdlib_files(150)
    straight, stopped = tmp_path / "data" / "x", tmp_path / "stopped" / "x"  # the same folder name: the same shard names
    args = ["--input", *inputs, "--shard_size", 20000, "--workers", 1]
    run("prepare_fineweb.py", *args, "--out_dir", straight, check=True)
    mtimes = {f: os.path.getmtime(f) for f in glob.glob(str(straight / "*.bin"))}
    proc = run("prepare_fineweb.py", *args, "--out_dir", straight, check=True)
    assert "skipping" in proc.stdout and "wrote" not in proc.stdout
    assert mtimes == {f: os.path.getmtime(f) for f in glob.glob(str(straight / "*.bin"))}

    # Ctrl-C after 3 shards, then SIGKILL at a random point after 5: each restart goes on where the run was
    for sig, shards in ((signal.SIGINT, 3), (signal.SIGKILL, 5)):
        proc = subprocess.Popen([sys.executable, os.path.join(REPO, "prepare_fineweb.py"), *map(str, args), "--out_dir",
                                 str(stopped)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                # Ctrl-C as at a terminal, also when these tests run as a background job (`&`),
                                # whose commands inherit SIGINT ignored
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        while proc.poll() is None and (not os.path.exists(stopped / "manifest.json")
                                       or len(json.load(open(stopped / "manifest.json"))["shards"]) < shards):
            time.sleep(0.01)
        proc.send_signal(sig)
        _, err = proc.communicate()
        if sig == signal.SIGINT:
            assert proc.returncode == 130 and "run the same command again" in err, err
    proc = run("prepare_fineweb.py", *args, "--out_dir", stopped, check=True)
    assert "skipping" in proc.stdout
    a_files, a = read_shards(straight)
    b_files, b = read_shards(stopped)
    assert [os.path.basename(f) for f in a_files] == [os.path.basename(f) for f in b_files]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_datasets_streaming_path_on_a_local_dataset(tmp_path):
    pytest.importorskip("datasets")
    docs = documents()
    data = tmp_path / "local_dataset"
    data.mkdir()
    with open(data / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    out = tmp_path / "out"
    run("prepare_fineweb.py", "--dataset", data, "--config", "", "--out_dir", out, "--shard_size", 4000, "--workers", 2,
        check=True)
    _, shards = read_shards(out)
    assert np.array_equal(np.concatenate(shards), expected_stream(docs))


def test_offline_hub_fails_at_once_pointing_to_input(tmp_path):
    start = time.time()
    proc = run("prepare_fineweb.py", "--out_dir", tmp_path / "out", env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and "--input" in proc.stderr and time.time() - start < 30


@pytest.mark.parametrize("case", ["no_match", "missing_field", "unreadable", "bad_json", "folder_config",
                                  "config_with_input", "text_field_with_txt"])
def test_bad_input_gives_one_line_error(case, tmp_path):
    expect = {"no_match": "matches no file", "missing_field": "no field 'text'", "unreadable": "cannot read",
              "bad_json": "a.jsonl:2 (JSONDecodeError", "folder_config": "check --dataset and --config",
              "config_with_input": "--config does nothing with --input; drop it",
              "text_field_with_txt": "--text_field does nothing with .txt (.md, .py) files"}[case]
    if case in ("config_with_input", "text_field_with_txt"):  # a flag that the source given does not use
        (tmp_path / "a.txt").write_text("hello\n")
        source = ["--input", str(tmp_path / "a.txt"),
                  *(["--config", "sample-100BT"] if case == "config_with_input" else ["--text_field", "body"])]
    elif case == "no_match":
        source = ["--input", str(tmp_path / "nothing*.jsonl")]
    elif case == "missing_field":
        (tmp_path / "a.jsonl").write_text(json.dumps({"content": "hello"}) + "\n")
        source = ["--input", str(tmp_path / "a.jsonl")]
    elif case == "unreadable":
        (tmp_path / "a.parquet").write_bytes(b"this is not parquet")
        source = ["--input", str(tmp_path / "a.parquet")]
    elif case == "bad_json":
        (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
        source = ["--input", str(tmp_path / "a.jsonl")]
    else:  # a local `datasets` folder with the default --config, which only the hub set has
        pytest.importorskip("datasets")
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "train.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
        source = ["--dataset", str(tmp_path / "data")]
    proc = run("prepare_fineweb.py", *source, "--out_dir", tmp_path / "out", "--workers", 1)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], proc.stderr


def test_demo_corpus_is_words_not_blanks(tmp_path):
    """The demo corpus: the prose of the stdlib's docstrings and reference topics, a paragraph a line, at most 25%
    whitespace-only tokens (the stdlib's raw source is 47%); its shards hold exactly stdlib_texts' documents' tokens."""
    import prepare_fineweb
    text = "Title\n=====\n\nOne line\nwrapped.  Two  spaces.\n\n    indented code\n>>> doctest\n\nLast."
    assert prepare_fineweb.reflow(text) == "Title\nOne line wrapped. Two spaces.\nLast."
    docs, _ = prepare_fineweb.stdlib_texts()
    assert any("Serialize ``obj`` to a JSON formatted ``str``" in d for d in docs)  # json.dumps's docstring
    assert any(d.startswith('The "assert" statement') for d in docs)  # pydoc_data's topics
    enc = get_tokenizer()
    blank = np.array([not enc.decode_single_token_bytes(i).strip() for i in range(EOT_TOKEN)] + [False])
    run("prepare_fineweb.py", "--demo", "--out_dir", tmp_path / "demo", "--workers", 1, check=True)
    files, shards = read_shards(tmp_path / "demo")
    assert os.path.basename(files[0]) == "demo_val_000000.bin" and len(files) > 4
    stream = np.concatenate(shards)
    assert np.array_equal(stream, expected_stream(docs))
    assert blank[stream].mean() <= 0.25, blank[stream].mean()


def test_a_rerun_on_other_input_is_refused_and_the_trainer_reads_only_listed_shards(tmp_path, capsys):
    """Whatever shapes the shards is in manifest.json: on a finished folder and on a stopped one, a rerun
    with an input file added or changed, or another --shard_size, is one error line and leaves the shards as
    they are (going on would mix two streams). The trainer then reads the listed shards only."""
    from train_gpt2 import find_shards
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    for path in stdlib_files(6):
        (src / os.path.basename(path)).write_bytes(open(path, "rb").read())
    args = ["--input", str(src / "*.py"), "--out_dir", out, "--shard_size", 8000, "--workers", 1]
    run("prepare_fineweb.py", *args, check=True)
    shards = {p.name: p.read_bytes() for p in out.glob("*.bin")}
    (src / "new.py").write_text("print('a file added after the shards were made')\n")
    for extra, differs in (([], "differs from this run in files"), (["--shard_size", 9], "in shard_size")):
        proc = run("prepare_fineweb.py", *args, *extra)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and differs in proc.stderr, proc.stderr
    (src / "new.py").unlink()
    # stopped after 2 shards (the manifest as an interrupted run leaves it), then a file already read changes
    manifest = json.load(open(out / "manifest.json"))
    stopped = {**manifest, "shards": manifest["shards"][:2], "complete": False}
    json.dump(stopped, open(out / "manifest.json", "w"))
    first = sorted(src.iterdir())[0]
    first.write_text("# a new first paragraph\n" + first.read_text())
    proc = run("prepare_fineweb.py", *args)
    assert proc.returncode == 2 and "differs from this run in files" in proc.stderr, proc.stderr
    assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == shards
    # a finished folder with a shard it does not list: not read, and said
    json.dump(manifest, open(out / "manifest.json", "w"))
    (out / "out_train_000099.bin").write_bytes(shards["out_train_000001.bin"])
    listed = [s["file"] for s in manifest["shards"][1:]]
    assert [os.path.basename(f) for f in find_shards(str(out), "train")] == listed
    note = "not using 1 train shard(s) that its manifest.json does not list (out_train_000099.bin)"
    assert note in capsys.readouterr().out


def test_a_stopped_prepare_run_again_with_its_inputs_in_another_order_is_refused(tmp_path):
    """The documents are read in the order the --input files are given, so that order shapes the shards: a
    run stopped part way and run again with the files reordered would repeat some documents and drop others.
    It is refused, and the same order goes on to the shards of a run never stopped."""
    src, straight, stopped = tmp_path / "src", tmp_path / "a" / "x", tmp_path / "b" / "x"
    src.mkdir()
    for path in stdlib_files(6):
        (src / os.path.basename(path)).write_bytes(open(path, "rb").read())
    files = sorted(str(f) for f in src.iterdir())
    given = files[3:] + files[:3]
    args = ["--shard_size", 4000, "--workers", 1]
    run("prepare_fineweb.py", "--input", *given, *args, "--out_dir", straight, check=True)
    run("prepare_fineweb.py", "--input", *given, *args, "--out_dir", stopped, check=True)
    # stopped after 2 shards: the manifest as an interrupted run leaves it
    manifest = json.load(open(stopped / "manifest.json"))
    json.dump({**manifest, "shards": manifest["shards"][:2], "complete": False}, open(stopped / "manifest.json", "w"))
    proc = run("prepare_fineweb.py", "--input", *files, *args, "--out_dir", stopped)
    assert proc.returncode == 2 and "differs from this run in files" in proc.stderr, proc.stderr
    run("prepare_fineweb.py", "--input", *given, *args, "--out_dir", stopped, check=True)
    a_files, a = read_shards(straight)
    b_files, b = read_shards(stopped)
    assert len(a) > 3 and [os.path.basename(f) for f in a_files] == [os.path.basename(f) for f in b_files]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("damage", ["a_list", "no_shards", "end_doc_text", "a_folder"])
def test_a_manifest_of_another_shape_is_one_error_line_in_prepare_and_in_the_trainer(damage, tmp_path):
    """A manifest.json that prepare_fineweb.py did not write (another tool's, or edited by hand), or a folder of
    that name: neither a prepare going on from it nor the trainer guesses; each says so in one line."""
    out = tmp_path / "data"
    args = ["--input", *stdlib_files(4), "--out_dir", out, "--shard_size", 2000, "--workers", 1]
    run("prepare_fineweb.py", *args, check=True)
    manifest = json.load(open(out / "manifest.json"))
    (out / "manifest.json").unlink()
    if damage == "a_folder":
        (out / "manifest.json").mkdir()
    else:
        manifest["shards"][-1]["end_doc"] = "12"
        manifest = {"a_list": manifest["shards"], "no_shards": {"complete": True},
                    "end_doc_text": manifest}[damage]
        (out / "manifest.json").write_text(json.dumps(manifest))
    for proc in (run("prepare_fineweb.py", *args),
                 run("train_gpt2.py", "--data_dir", out, "--out_dir", tmp_path / "run", "--device", "cpu")):
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {out / 'manifest.json'} is not a manifest that "
                                                       f"prepare_fineweb.py wrote"), proc.stderr


def test_a_listed_shard_deleted_or_cut_short_is_made_again(tmp_path):
    """The trainer refuses a folder that lacks a shard its manifest lists, and tells the user to run the prepare
    command again: that command makes the shard again (and those after it, the same stream), saying so."""
    out = tmp_path / "x"
    args = ["--input", *stdlib_files(6), "--out_dir", out, "--shard_size", 4000, "--workers", 1]
    run("prepare_fineweb.py", *args, check=True)
    shards = {p.name: p.read_bytes() for p in out.glob("*.bin")}
    assert len(shards) > 3
    (out / "x_train_000002.bin").unlink()
    (out / "x_train_000003.bin").write_bytes(shards["x_train_000003.bin"][:-2])
    for gone in ("x_train_000002.bin", "x_train_000003.bin"):
        proc = run("prepare_fineweb.py", *args, check=True)
        assert f"{out / gone}, which manifest.json lists, is missing or not whole" in proc.stderr, proc.stderr
        assert {p.name: p.read_bytes() for p in out.glob("*.bin")} == shards
        assert json.load(open(out / "manifest.json"))["complete"] is True
        (out / "x_train_000003.bin").write_bytes(shards["x_train_000003.bin"][:-2])
    # an empty --out_dir is one line, not the default folder under the working directory
    proc = subprocess.run([sys.executable, os.path.join(REPO, "prepare_fineweb.py"), *map(str, args[:-6]),
                           "--out_dir", "", "--workers", "1"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --out_dir '' names no folder"), proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "data").exists()


def test_the_trainer_takes_a_corpus_whose_last_shard_is_shorter_than_a_step(tmp_path):
    """prepare's last shard holds what is left: here 201 tokens, fewer than a step's 256. It is skipped as
    every shard's tail is, with a line; the run trains on the rest."""
    from conftest import TINY
    (tmp_path / "doc.txt").write_text("Hello" + " world" * 3199)  # 3,201 tokens with the <|endoftext|>
    run("prepare_fineweb.py", "--input", tmp_path / "doc.txt", "--out_dir", tmp_path / "data", "--shard_size", 1000,
        "--workers", 1, check=True)
    assert [s["tokens"] for s in json.load(open(tmp_path / "data" / "manifest.json"))["shards"]][-1] == 201
    proc = run("train_gpt2.py", *TINY, "--data_dir", tmp_path / "data", "--out_dir", tmp_path / "out",
               "--max_steps", 2, check=True)
    assert "skipping data_train_000003.bin: fewer tokens than one step over all ranks reads (257)" in proc.stdout


def test_a_reader_that_goes_away_stops_the_output_not_the_work(tmp_path):
    (tmp_path / "doc.txt").write_text("Hello" + " world" * 3199)
    cmd = [sys.executable, "prepare_fineweb.py", "--input", tmp_path / "doc.txt", "--out_dir", tmp_path / "data",
           "--shard_size", "1000", "--workers", "1"]
    # | head -1: the pipe is closed before the first line
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        proc.stdout.close()
        stderr = proc.stderr.read().decode()
    assert proc.returncode == 0 and stderr == "", stderr
    manifest = json.load(open(tmp_path / "data" / "manifest.json"))
    assert manifest["complete"] and len(manifest["shards"]) == 4
