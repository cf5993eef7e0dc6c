import json

import pytest
import torch

from conftest import run, torchrun
from train_gpt2 import GPT, GPTConfig, evaluate_hellaswag, get_tokenizer, load_hellaswag, render_hellaswag, score_hellaswag

CONTEXTS = [
    ("Removing ice from car", "Then, the man writes over the snow covering the window of a car, and a woman wearing "
     "winter clothes smiles.", "then", ", the man adds wax to the windshield and cuts it.",
     ", a person board a ski lift, while two men supporting the head of the person wearing winter clothes snow as "
     "the we girls sled.", ", the man puts on a christmas coat, knitted with netting.",
     ", the man continues removing the snow on his car."),
    ("Baking cookies", "A female chef in white uniform shows a stack of baking pans in a large kitchen presenting "
     "them.", "the pans", "contain egg yolks and baking soda.", "are then sprinkled with brown sugar.",
     "are placed in a strainer on the counter.", "are filled with pastries and loaded into the oven."),
    ("Playing guitar", "A man is sitting on a chair holding a guitar. He", "strums", "the guitar and starts to sing.",
     "eats the guitar slowly.", "throws the chair into the lake.", "paints the guitar with a fish."),
]


def write_fixture(path, n=12):
    with open(path, "w") as f:
        for i in range(n):
            label, ctx_a, ctx_b, *endings = CONTEXTS[i % len(CONTEXTS)]
            f.write(json.dumps({"ind": i, "activity_label": label, "ctx_a": ctx_a, "ctx_b": ctx_b,
                                "ctx": f"{ctx_a} {ctx_b}", "split": "val", "split_type": "indomain",
                                "label": (i * 7) % 4, "endings": endings, "source_id": f"fixture~{i}"}) + "\n")


def test_rendering_tokens_and_mask(tmp_path):
    write_fixture(tmp_path / "h.jsonl", 3)
    examples = load_hellaswag(tmp_path / "h.jsonl")
    enc = get_tokenizer()
    rows, masks, label = render_hellaswag(examples[2], enc)
    ctx = enc.encode("A man is sitting on a chair holding a guitar. He strums")
    assert label == 14 % 4 and len(rows) == 4
    assert rows[0] == ctx + enc.encode(" the guitar and starts to sing.")
    assert masks[0] == [0] * len(ctx) + [1] * (len(rows[0]) - len(ctx))
    assert all(len(r) == len(m) for r, m in zip(rows, masks))


def test_text_that_reads_as_a_special_token_is_scored_as_text(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_text(json.dumps({"ctx": "A tag <|endoftext|> reads", "endings": ["a", "<|endoftext|>", "c", "d"],
                                "label": "1"}) + "\n")  # the label as the hub's copy writes it
    enc = get_tokenizer()
    rows, masks, label = render_hellaswag(load_hellaswag(path)[0], enc)
    assert label == 1 and rows[1] == enc.encode_ordinary("A tag <|endoftext|> reads <|endoftext|>")
    assert 50256 not in sum(rows, [])


def test_batched_scoring_equals_one_at_a_time(tmp_path):
    write_fixture(tmp_path / "h.jsonl", 12)
    examples = load_hellaswag(tmp_path / "h.jsonl")
    enc = get_tokenizer()
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=128, n_layer=2, n_head=2, n_embd=32)).eval()
    rendered = [render_hellaswag(ex, enc) for ex in examples]
    batched = score_hellaswag(model, rendered, "cpu", 50257)
    singles = [score_hellaswag(model, [r], "cpu", 50257) for r in rendered]
    assert batched == ([s[0][0] for s in singles], [s[1][0] for s in singles])
    assert evaluate_hellaswag(model, examples, enc, "cpu", batch_size=5) == \
        evaluate_hellaswag(model, examples, enc, "cpu", batch_size=1)


def test_examples_longer_than_the_context_are_cropped_from_the_left(tmp_path, capsys):
    """A model whose context is shorter than an example scores it on the example's last block_size tokens (it ended
    in an AssertionError before), says so, and scores exactly as the cropped rows would."""
    write_fixture(tmp_path / "h.jsonl", 6)
    examples = load_hellaswag(tmp_path / "h.jsonl")
    enc = get_tokenizer()
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=24, n_layer=2, n_head=2, n_embd=32)).eval()
    rendered = [render_hellaswag(ex, enc) for ex in examples]
    long = sum(max(map(len, rows)) > 24 for rows, _, _ in rendered)
    assert 0 < long < len(examples)  # 2 of the 3 kinds of example are longer (51 and 32 tokens), 1 fits (21)
    cropped = [([r[-24:] for r in rows], [m[-24:] for m in masks], label) for rows, masks, label in rendered]
    pred, pred_norm = score_hellaswag(model, cropped, "cpu", 50257)
    labels = [label for _, _, label in rendered]
    expected = (sum(p == y for p, y in zip(pred, labels)) / 6, sum(p == y for p, y in zip(pred_norm, labels)) / 6, 6)
    assert evaluate_hellaswag(model, examples, enc, "cpu", batch_size=4) == expected
    assert f"hellaswag: {long} of 6 examples are longer than the model's context (24 tokens)" in capsys.readouterr().out


def test_cli_counts_and_two_processes_match_one(base_ckpt, tmp_path):
    write_fixture(tmp_path / "h.jsonl", 14)
    args = ["--ckpt", base_ckpt, "--data_file", tmp_path / "h.jsonl", "--device", "cpu", "--dtype", "float32"]
    one = json.loads(run("hellaswag.py", *args, "--batch_size", 4, check=True).stdout)
    singles = json.loads(run("hellaswag.py", *args, "--batch_size", 1, check=True).stdout)
    two = json.loads(torchrun("hellaswag.py", *args).stdout.strip().splitlines()[-1])
    assert one["examples"] == two["examples"] == 14
    assert (one["acc"], one["acc_norm"]) == (singles["acc"], singles["acc_norm"]) == (two["acc"], two["acc_norm"])
    limited = json.loads(run("hellaswag.py", *args, "--limit", 5, check=True).stdout)
    assert limited["examples"] == 5


@pytest.mark.parametrize("case", ["missing_file", "malformed", "no_model"])
def test_bad_input_gives_one_line_error(case, base_ckpt, tmp_path):
    path = tmp_path / "h.jsonl"
    write_fixture(path, 3)
    if case == "malformed":
        with open(path, "a") as f:
            f.write('{"ctx": "no endings here"}\n')
    args = {"missing_file": ["--ckpt", base_ckpt, "--data_file", tmp_path / "none.jsonl"],
            "malformed": ["--ckpt", base_ckpt, "--data_file", path], "no_model": ["--data_file", path]}[case]
    expect = {"missing_file": "is not a file", "malformed": "h.jsonl:4 is not a HellaSwag example",
              "no_model": "--ckpt"}[case]
    proc = run("hellaswag.py", *args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and expect in lines[0], proc.stderr


def test_without_a_file_offline_says_to_give_one(base_ckpt, tmp_path):
    proc = run("hellaswag.py", "--ckpt", base_ckpt, "--cache_dir", tmp_path / "cache", "--limit", 2)
    if proc.returncode == 0:
        pytest.skip("online: the official file was downloaded")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "--data_file" in lines[0], proc.stderr
