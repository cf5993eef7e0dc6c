import copy
import json
import os
import random
import re
import subprocess
import sys
from collections import Counter
from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mid_train
from conftest import REPO, run, torchrun, train_losses, val_losses

MID = ["--micro_batch_size", "4", "--seq_len", "64", "--lr", "3e-3", "--dtype", "float32", "--device", "cpu",
       "--num_samples", "0", "--val_fraction", "0.1", "--compile", "off"]


def conversations(n=240, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        turns = [{"role": "user", "content": f"What is {a} plus {b}?"},
                 {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
        if i % 3 == 0:
            turns = [{"role": "system", "content": "You are a calculator."}] + turns + [
                {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "You are welcome."}]
        out.append(turns)
    return out


def write_chat(path, convs, wrapped=True):
    with open(path, "w") as f:
        for c in convs:
            f.write(json.dumps({"messages": c} if wrapped else c) + "\n")


def test_rendering_round_trips_and_masks_only_the_assistant():
    enc = mid_train.get_chat_tokenizer()
    conv = conversations(3)[0]
    ids, mask = mid_train.render_conversation(enc, conv)
    assert enc.decode(ids) == "".join(["<|bos|>"] + [f"<|{m['role']}_start|>{m['content']}<|{m['role']}_end|>" for m in conv])
    learned = enc.decode([t for t, m in zip(ids, mask) if m])
    assert learned == "".join(f"{m['content']}<|assistant_end|>" for m in conv if m["role"] == "assistant")
    assert all(t >= 50257 for t in enc.encode("<|bos|><|user_start|><|assistant_end|>", allowed_special="all"))


def test_packing_invariants():
    enc = mid_train.get_chat_tokenizer()
    items = [mid_train.render(enc, c) for c in conversations(200)]
    items.append(mid_train.render(enc, [{"role": "user", "content": "word " * 200},
                                        {"role": "assistant", "content": "ok"}]))
    capacity = 65
    items = [(ids[:capacity], mask[:capacity]) for ids, mask in items]  # build_data crops them
    tokens, mask = mid_train.pack_rows(items, capacity, random.Random(0))
    assert tokens.shape[1] == capacity
    bos = enc.encode_single_token("<|bos|>")
    assert (tokens[:, 0] == bos).all()  # every row starts at a conversation start
    assert (tokens == bos).sum() == len(items)  # every conversation exactly once
    assert (tokens != mid_train.EOT_TOKEN).sum() == sum(len(ids) for ids, _ in items)
    assert mask.sum() == sum(m.sum() for _, m in items)
    fills = (tokens != mid_train.EOT_TOKEN).sum(1)  # the rest of a row is padding
    assert sum(fill <= capacity // 2 for fill in fills) <= 1  # best fit: at most one row is half empty or less


def test_epochs_repeat_each_conversation(tmp_path):
    write_chat(tmp_path / "a.jsonl", conversations(50))
    args = mid_train.get_args(["--init_from", "gpt2", "--data", f"chat:{tmp_path / 'a.jsonl'}:3",
                               "--val_fraction", "0.1", "--out_dir", str(tmp_path / "run")])
    splits, _ = mid_train.build_data(args, mid_train.get_chat_tokenizer(), 65)
    assert splits["train"][2] == 45 * 3 and splits["val"][2] == 5


def test_each_epoch_is_packed_on_its_own_into_compact_arrays(tmp_path):
    convs = [[{"role": "user", "content": f"Tell me about number {i}."},
              {"role": "assistant", "content": f"{i} is a number" + " and a fine one" * (i % 5)}] for i in range(100)]
    write_chat(tmp_path / "a.jsonl", convs)
    args = mid_train.get_args(["--init_from", "gpt2", "--out_dir", str(tmp_path / "run"),
                               "--data", f"chat:{tmp_path / 'a.jsonl'}:2",
                               "--val_fraction", "0.1"])
    enc = mid_train.get_chat_tokenizer()
    tokens, mask, count = mid_train.build_data(args, enc, 65)[0]["train"]
    rows = [re.findall(r"about number (\d+)\.", enc.decode(row.tolist())) for row in tokens]
    assert all(len(set(row)) == len(row) for row in rows)  # no row holds two copies of one conversation
    uses = Counter(i for row in rows for i in row)
    assert len(uses) == 90 and set(uses.values()) == {2} and count == 180
    assert tokens.dtype == np.uint16 and mask.dtype == bool  # 3 bytes a token, not Python lists
    assert tokens.nbytes + mask.nbytes == 3 * tokens.size


def test_step_loss_and_gradient_are_the_mean_over_every_target():
    # three micro-batches with 64, 1 and 0 targets: the loss is the mean over all 65, not a mean of micro-batch means
    torch.manual_seed(0)
    model = mid_train.GPT(mid_train.GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    reference = copy.deepcopy(model)
    x, y = torch.randint(0, 64, (3, 4, 16)), torch.randint(0, 64, (3, 4, 16))
    y[1:] = -1
    y[1, 2, 7] = 5
    logits = reference(x.flatten(0, 1))
    expected = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1)
    expected.backward()
    batches = iter(zip(x, y))
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = mid_train.train_step(model, [sgd], torch.amp.GradScaler("cpu", enabled=False),
                                   lambda: next(batches), 3, 65, 0.0, nullcontext())
    loss = metrics["loss"]
    assert abs(loss.item() - expected.item()) < 1e-6, (loss, expected)  # finite, though a micro-batch learns nothing
    for before, after in zip(reference.parameters(), model.parameters()):  # one SGD step of lr 1 moved them by -grad
        torch.testing.assert_close(before.detach() - after.detach(), before.grad, rtol=0, atol=1e-6)


def test_fsdp_with_fewer_val_rows_than_ranks_times_batch_matches_ddp_and_the_reference(base_ckpt, tmp_path):
    write_chat(tmp_path / "chat.jsonl", conversations(100))
    flags = [*MID, "--init_ckpt", base_ckpt, "--data", f"chat:{tmp_path / 'chat.jsonl'}", "--val_fraction", 0.05,
             "--max_steps", 3]
    ddp = torchrun("mid_train.py", *flags, "--out_dir", tmp_path / "ddp", timeout=180)
    assert "in 2 rows" in ddp.stdout  # 2 val rows for 2 ranks of micro-batch 4: before the padding, FSDP hung here
    torchrun("mid_train.py", *flags, "--out_dir", tmp_path / "fsdp", "--fsdp", timeout=180)
    a, b = train_losses(tmp_path / "ddp"), train_losses(tmp_path / "fsdp")
    assert sorted(b) == [0, 1, 2] and all(abs(a[s] - b[s]) < 1e-4 for s in a), (a, b)
    val_a, val_b = val_losses(tmp_path / "ddp"), val_losses(tmp_path / "fsdp")
    assert sorted(val_b) == [0, 3] and all(abs(val_a[s] - val_b[s]) < 1e-4 for s in val_a), (val_a, val_b)

    # step 0's train loss (8 rows, 4 on each rank) and val loss: the mean over every learned token, from the model
    args = mid_train.get_args(list(map(str, [*flags, "--out_dir", tmp_path / "run"])))
    splits, _ = mid_train.build_data(args, mid_train.get_chat_tokenizer(), 65)
    model = mid_train.model_from_checkpoint(mid_train.load_checkpoint(base_ckpt)[0])
    for (tokens, mask, _), logged in ((splits["train"], a[0]), (splits["val"], val_a[0])):
        tokens, mask = torch.from_numpy(tokens[:8]).long(), torch.from_numpy(mask[:8])
        with torch.no_grad():
            logits = model(tokens[:, :-1])
        expected = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].masked_fill(~mask[:, 1:], -1).flatten(),
                                   ignore_index=-1)
        assert abs(logged - expected.item()) < 1e-5, (logged, expected)


def test_the_lr_decays_to_zero_at_the_last_trained_step_however_few_the_steps():
    from argparse import Namespace
    for max_steps in (3, 10, 1000):
        args = Namespace(max_steps=max_steps, warmdown_frac=0.2, init_lr_frac=1.0)
        lrs = [mid_train.lr_multiplier(step, args) for step in range(max_steps)]  # the steps that train
        assert lrs[0] == 1.0 and lrs[-1] == 0.0 and all(a >= b for a, b in zip(lrs, lrs[1:])), lrs
    # --init_lr_frac: the schedule starts at that share of the peak (nanochat's), and decays from there
    args = Namespace(max_steps=10, warmdown_frac=0.5, init_lr_frac=0.25)
    assert [mid_train.lr_multiplier(step, args) for step in (0, 9)] == [0.25, 0.0]


def test_each_pass_reads_the_steps_in_a_new_order_that_follows_from_the_step_number():
    passes = [[mid_train.first_row_of(step, 10, 4, seed=1337) for step in range(10 * p, 10 * p + 10)]
              for p in range(3)]
    assert passes[0] == list(range(0, 40, 4))  # the first pass in packed order
    assert all(sorted(rows) == passes[0] for rows in passes) and passes[0] != passes[1] != passes[2]


def test_midtraining_lowers_val_loss_and_chats(base_ckpt, tmp_path):
    write_chat(tmp_path / "chat.jsonl", conversations(240))
    write_chat(tmp_path / "bare.jsonl", conversations(60, seed=1), wrapped=False)
    out = tmp_path / "mid"
    run("mid_train.py", *MID, "--init_ckpt", base_ckpt, "--data", f"chat:{tmp_path / 'chat.jsonl'}",
               f"chat:{tmp_path / 'bare.jsonl'}:2", "--out_dir", out, "--max_steps", 100, "--eval_every", 50,
               "--micro_batch_size", 8, "--lr", 5e-3, check=True)  # at 1e-2 a float rounding flips the greedy reply
    val = val_losses(out)
    assert val[100] < val[50] < val[0] - 5.0, val
    chat = subprocess.run([sys.executable, "sample.py", "--ckpt", str(out), "--chat", "--temperature", "0",
                           "--max_new_tokens", "20"], input="What is 3 plus 4?\n", cwd=REPO, capture_output=True,
                          text=True)
    assert chat.returncode == 0, chat.stderr
    reply = chat.stdout.split("assistant: ", 1)[1].split("\n")[0]
    assert "plus" in reply  # it answers in the shape it was taught, and stops at <|assistant_end|>
    assert "<|" not in reply
    from test_hellaswag import write_fixture
    write_fixture(tmp_path / "h.jsonl", 4)
    scored = json.loads(run("hellaswag.py", "--ckpt", out, "--data_file", tmp_path / "h.jsonl", check=True).stdout)
    assert scored["examples"] == 4  # a midtrained checkpoint evaluates like a base one


def test_ddp_matches_single_process_and_resume_is_exact(base_ckpt, tmp_path):
    write_chat(tmp_path / "chat.jsonl", conversations(240))
    flags = [*MID, "--init_ckpt", base_ckpt, "--data", f"chat:{tmp_path / 'chat.jsonl'}", "--max_steps", 8,
             "--eval_every", 4, "--save_every", 4, "--total_batch_size", 512]
    # one process in 4 micro-batches of 2 rows, two in one of 4 rows each: the same loss (the mean over every
    # learned token of the step), however the rows are grouped
    run("mid_train.py", *flags, "--micro_batch_size", 2, "--out_dir", tmp_path / "single", check=True)
    torchrun("mid_train.py", *flags, "--out_dir", tmp_path / "ddp")
    single, ddp = train_losses(tmp_path / "single"), train_losses(tmp_path / "ddp")
    assert sorted(ddp) == list(range(8)) and all(abs(single[s] - ddp[s]) < 1e-5 for s in single), (single, ddp)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (resumed / "ckpt_0000004.pt").hardlink_to(tmp_path / "single" / "ckpt_0000004.pt")
    same_base = os.path.join(os.path.dirname(base_ckpt), ".", os.path.basename(base_ckpt))  # spelled another way
    run("mid_train.py", *[same_base if f == base_ckpt else f for f in flags], "--micro_batch_size", 2,
        "--out_dir", resumed, "--resume", check=True)
    again = train_losses(resumed)
    assert sorted(again) == [4, 5, 6, 7] and all(again[s] == single[s] for s in again)
    assert val_losses(resumed)[8] == val_losses(tmp_path / "single")[8]


@pytest.mark.parametrize("case", ["malformed", "unknown_role", "empty"])
def test_bad_data_names_file_and_line(case, base_ckpt, tmp_path):
    good = json.dumps({"messages": conversations(1)[0]})
    bad = {"malformed": '{"messages": [', "unknown_role": json.dumps([{"role": "robot", "content": "beep"}]),
           "empty": json.dumps({"messages": []})}[case]
    path = tmp_path / "chat.jsonl"
    path.write_text(f"{good}\n{good}\n{bad}\n")
    proc = run("mid_train.py", *MID, "--init_ckpt", base_ckpt, "--data", f"chat:{path}", "--out_dir", tmp_path / "o")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and f"{path}:3" in lines[0], proc.stderr
    assert {"malformed": "not valid JSON", "unknown_role": "roles [robot]", "empty": "roles []"}[case] in lines[0]


GSM8K_ROW = {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
                         "May. How many clips did Natalia sell altogether in April and May?",
             "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                       "altogether in April and May.\n#### 72"}


def test_gsm8k_calculator_calls_render_as_tool_calls_with_the_tools_output_masked(tmp_path):
    (tmp_path / "gsm8k.jsonl").write_text(json.dumps(GSM8K_ROW) + "\n")
    enc = mid_train.get_chat_tokenizer()
    [(ids, mask)] = mid_train.load_source(enc, "gsm8k", str(tmp_path / "gsm8k.jsonl"))
    ids = ids.tolist()
    call = "<|python_start|>{}<|python_end|><|output_start|>{}<|output_end|>"
    reply = (f"Natalia sold 48/2 = {call.format('48/2', 24)}24 clips in May.\nNatalia sold 48+24 = "
             f"{call.format('48+24', 72)}72 clips altogether in April and May.\n#### 72")
    assert enc.decode(ids) == (f"<|bos|><|user_start|>{GSM8K_ROW['question']}<|user_end|><|assistant_start|>{reply}"
                               f"<|assistant_end|>")
    # learned: the assistant's text and calls, not the tool's outputs (nor the question, as before)
    learned = enc.decode([t for t, m in zip(ids, mask) if m])
    assert learned == re.sub(r"<\|output_start\|>\d+<\|output_end\|>", "", reply) + "<|assistant_end|>"
    outputs = [t for t, m in zip(ids, mask) if not m and t >= enc.encode_single_token("<|output_start|>")]
    assert enc.decode(outputs) == "<|output_start|><|output_end|>" * 2
    assert ids[:ids.index(enc.encode_single_token("<|assistant_start|>")) + 1] == mid_train.render_for_reply(
        enc, [{"role": "user", "content": GSM8K_ROW["question"]}])  # the question renders as any user message


def write_words(path):
    path.write_text("strawberry\nBanana\nco-op\nkayak\n\nmississippi\n")  # "co-op" is no word of letters a-z


def test_spelling_tasks_are_nanochats_rows_generated_from_a_word_list_the_same_for_a_seed(tmp_path):
    write_words(tmp_path / "words.txt")
    words = {"strawberry", "banana", "kayak", "mississippi"}
    spell = mid_train.spelling_conversations("simplespelling", str(tmp_path / "words.txt"), 20, "train 1")
    for user, assistant in spell:
        word = user["content"].removeprefix("Spell the word: ")
        assert word in words and assistant["content"] == f"{word}:{','.join(word)}"
    bee = mid_train.spelling_conversations("spellingbee", str(tmp_path / "words.txt"), 50, "train 1")
    assert bee == mid_train.spelling_conversations("spellingbee", str(tmp_path / "words.txt"), 50, "train 1")
    assert bee != mid_train.spelling_conversations("spellingbee", str(tmp_path / "words.txt"), 50, "train 2")
    for user, assistant in bee:
        text, call, output, answer = assistant["content"]
        word, letter = re.search(r"'(\w+)'\.count\('(\w)'\)", call["text"]).groups()
        assert word in words and word in user["content"] and call["type"] == "python"
        assert output == {"type": "python_output", "text": str(word.count(letter))}
        assert f"{word}:{','.join(word)}" in text["text"] and text["text"].count("hit!") == word.count(letter)
        assert answer["text"].endswith(f"#### {word.count(letter)}")
    enc = mid_train.get_chat_tokenizer()
    ids, mask = mid_train.render_conversation(enc, bee[0])
    assert mask[ids.index(enc.encode_single_token("<|output_start|>"))] == 0
    # in --data their sizes are rows; generated, they hold nothing out for val
    write_chat(tmp_path / "chat.jsonl", conversations(20))
    args = mid_train.get_args(["--init_from", "gpt2", "--out_dir", str(tmp_path / "run"),
                               "--data", f"chat:{tmp_path / 'chat.jsonl'}",
                               f"simplespelling:{tmp_path / 'words.txt'}:30", f"spellingbee:{tmp_path / 'words.txt'}:12",
                               "--val_fraction", "0.1"])
    splits, _ = mid_train.build_data(args, enc, 1025)
    assert splits["train"][2] == 18 + 30 + 12 and splits["val"][2] == 2


def test_val_is_a_share_held_out_of_each_source_read_from_files(tmp_path, capsys):
    write_chat(tmp_path / "chat.jsonl", conversations(40))
    rows = [dict(GSM8K_ROW, question=f"{GSM8K_ROW['question']} ({i})") for i in range(20)]
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_words(tmp_path / "words.txt")
    args = mid_train.get_args(["--init_from", "gpt2", "--out_dir", str(tmp_path / "run"),
                               "--data", f"chat:{tmp_path / 'chat.jsonl'}:2", f"gsm8k:{tmp_path / 'gsm8k.jsonl'}",
                               f"spellingbee:{tmp_path / 'words.txt'}:12", "--val_fraction", "0.1"])
    enc = mid_train.get_chat_tokenizer()
    splits, _ = mid_train.build_data(args, enc, 1025)
    # train: 36 chats twice, 18 GSM8K rows and 12 generated ones; val: 4 chats and 2 GSM8K rows, none generated
    assert splits["train"][2] == 36 * 2 + 18 + 12 and splits["val"][2] == 4 + 2
    train_text, val_text = (enc.decode(splits[name][0].flatten().tolist()) for name in ("train", "val"))
    val_questions = set(re.findall(r"May\? \((\d+)\)", val_text))
    assert len(val_questions) == 2 and not val_questions & set(re.findall(r"May\? \((\d+)\)", train_text))
    held_out = [line for line in capsys.readouterr().out.splitlines() if "held out" in line]  # said in a line
    assert len(held_out) == 2 and "chat.jsonl held out, 4 conversations" in held_out[0], held_out


def test_a_mixture_of_generated_sources_only_evaluates_on_rows_of_another_seed(tmp_path, capsys):
    """A spelling-only mixture can be trained: it holds out no rows of its own, so --val_fraction of its rows are
    generated for val from another seed, and a line says so."""
    write_words(tmp_path / "words.txt")
    args = mid_train.get_args(["--init_from", "gpt2", "--out_dir", str(tmp_path / "run"),
                               "--data", f"simplespelling:{tmp_path / 'words.txt'}:200"])
    splits, _ = mid_train.build_data(args, mid_train.get_chat_tokenizer(), 1025)
    assert splits["train"][2] == 200 and splits["val"][2] == 4  # 2% of 200
    assert "simplespelling" in capsys.readouterr().out.split("4 conversations generated with another seed")[0]


def test_a_continued_run_refuses_data_changed_since_even_reordered(base_ckpt, tmp_path):
    """Reordered rows keep every count the same; the hash of each source's rows, kept in the checkpoint, does
    not: the run goes on only on the rows it trained on."""
    convs = conversations(40)
    write_chat(tmp_path / "chat.jsonl", convs)
    at = MID.index("--num_samples")  # --eval_every 0 refuses it
    flags = [*MID[:at], *MID[at + 2:], "--init_ckpt", base_ckpt, "--data", f"chat:{tmp_path / 'chat.jsonl'}",
             "--eval_every", 0, "--out_dir", tmp_path / "run"]
    run("mid_train.py", *flags, "--max_steps", 2, check=True)
    write_chat(tmp_path / "chat.jsonl", convs[::-1])
    proc = run("mid_train.py", *flags, "--max_steps", 3)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert f"--data chat:{tmp_path / 'chat.jsonl'}: its conversations are not those" in lines[0], lines[0]
