"""The train loader's order (--data_order): each epoch reads every window once, shuffled or in file order,
resumes exactly from its state, and splits a step over ranks the same way whatever the process count."""

import numpy as np
import pytest

from train_gpt2 import ShardLoader

LENGTHS = [1000, 1300, 777]  # shards of different sizes, none a whole number of windows


@pytest.fixture
def files(tmp_path):
    """Shards whose tokens are their own global position, so a batch says where it was read."""
    paths, offset = [], 0
    for i, n in enumerate(LENGTHS):
        path = str(tmp_path / f"t_train_{i:06d}.npy")
        np.save(path, np.arange(offset, offset + n, dtype=np.uint16))
        paths.append(path)
        offset += n
    return paths


def read(loader, n):
    return [tuple(t.clone() for t in loader.next_batch()) for _ in range(n)]


def window_starts(batches, span):
    """The first token of each window: the first micro-batch of every span."""
    return [int(x[0, 0]) for x, _ in batches[::span]]


@pytest.mark.parametrize("order", ["shuffled", "sequential"])
def test_an_epoch_reads_every_window_once(files, order):
    B, T, span = 2, 8, 3
    loader = ShardLoader(files, B, T, 0, 1, micro_batches_per_window=span, seed=7 if order == "shuffled" else None)
    W = B * T * span
    offsets = np.cumsum([0] + LENGTHS[:-1])
    every = sorted(int(o) + W * k for o, n in zip(offsets, LENGTHS) for k in range((n - 1) // W))
    per_epoch = len(every)
    assert per_epoch == loader.num_windows == sum((n - 1) // W for n in LENGTHS)
    epochs = []
    for _ in range(2):
        batches = read(loader, per_epoch * span)
        for i, (x, y) in enumerate(batches):  # a window's micro-batches are consecutive; targets are the next tokens
            assert int(x[0, 0]) == int(batches[i - i % span][0][0, 0]) + (i % span) * B * T and (y == x + 1).all()
        epochs.append(window_starts(batches, span))
    for starts in epochs:
        assert sorted(starts) == every  # each window once: none repeated, none skipped
    read(loader, 1)
    assert loader.epoch == 2
    if order == "sequential":
        assert epochs[0] == epochs[1] == every
    else:  # a new order each epoch, of the shards and of the windows in them
        assert epochs[0] != every and epochs[1] != epochs[0]
        shard_of = lambda s: int(np.searchsorted(offsets, s, side="right")) - 1  # noqa: E731
        shards_read = [shard_of(s) for s in epochs[0]]
        assert shards_read == sorted(shards_read, key=shards_read.index) and shards_read != sorted(shards_read)


def old_loader_batches(files, B, T, rank, world_size, n):
    """train_gpt2.py's loader before --data_order (build-nanogpt's order), as a reference."""
    shards = [np.load(f) for f in files]
    shard, pos, out = 0, 0, []
    for _ in range(n):
        if pos + B * T * world_size + 1 > len(shards[shard]):
            shard, pos = (shard + 1) % len(shards), 0
        start = pos + B * T * rank
        buf = shards[shard][start: start + B * T + 1].astype(np.int64)
        out.append((buf[:-1].reshape(B, T), buf[1:].reshape(B, T)))
        pos += B * T * world_size
    return out


def test_sequential_is_the_old_order(files):
    n = 3 * sum(n // 16 for n in LENGTHS)  # three epochs and more
    got = read(ShardLoader(files, 2, 4, 1, 2), n)
    want = old_loader_batches(files, 2, 4, 1, 2, n)
    assert all((x.numpy() == wx).all() and (y.numpy() == wy).all() for (x, y), (wx, wy) in zip(got, want))


def test_ranks_split_a_step_as_one_process_does(files):
    """2 ranks with one micro-batch a step read, between them, what 1 process reads in its 2 micro-batches."""
    one = read(ShardLoader(files, 2, 8, 0, 1, micro_batches_per_window=2, seed=3), 2 * 200)
    ranks = [read(ShardLoader(files, 2, 8, r, 2, micro_batches_per_window=1, seed=3), 200) for r in range(2)]
    for step in range(200):
        for r in range(2):
            assert (one[2 * step + r][0] == ranks[r][step][0]).all() and (one[2 * step + r][1] == ranks[r][step][1]).all()


def test_resume_from_state_is_exact(files):
    straight = ShardLoader(files, 2, 8, 0, 1, micro_batches_per_window=2, seed=5)
    want = read(straight, 500)  # past the end of the first epoch (~110 micro-batches) and well into later ones
    for cut in (0, 1, 37, 110, 111, 250):
        first = ShardLoader(files, 2, 8, 0, 1, micro_batches_per_window=2, seed=5)
        read(first, cut)
        state = first.state()
        assert all(type(v) in (int, str) for v in state.values())  # plain values: torch.load(weights_only) reads them
        resumed = ShardLoader(files, 2, 8, 0, 1, micro_batches_per_window=2, seed=5)
        resumed.load_state(state)
        got = read(resumed, 500 - cut)
        assert all((g[0] == w[0]).all() for g, w in zip(got, want[cut:]))


def test_other_batch_size_on_resume_is_an_error(files, capsys):
    first = ShardLoader(files, 2, 8, 0, 1, micro_batches_per_window=2, seed=5)
    read(first, 20)
    with pytest.raises(SystemExit) as e:
        ShardLoader(files, 2, 8, 0, 1, micro_batches_per_window=4, seed=5).load_state(first.state())  # windows of 64 tokens, not 32
    assert e.value.code == 2 and "--total_batch_size" in capsys.readouterr().err
