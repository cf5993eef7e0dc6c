"""The newcomer's path, offline: prepare_fineweb.py --demo -> train_gpt2.py --demo -> mid_train.py --demo ->
sample.py --chat, at a reduced size; and the export of a checkpoint to a transformers folder."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import mid_train
import prepare_fineweb
from conftest import REPO, read_log, run
from train_gpt2 import get_tokenizer, load_checkpoint, model_from_checkpoint

SMALL = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "64", "--seq_len", "64",
         "--micro_batch_size", "4", "--total_batch_size", "256", "--dtype", "float32", "--device", "cpu",
         "--compile", "off"]


def test_demo_conversations_hold_out_names():
    _, names = prepare_fineweb.stdlib_texts()
    assert dict(names)["json.dumps"].startswith("Serialize ``obj`` to a JSON formatted ``str``")
    held_out = {name for name, _ in names if prepare_fineweb.is_held_out(name)}
    assert 0.07 < len(held_out) / len(names) < 0.13
    conversations = [json.loads(line)["messages"] for line in prepare_fineweb.demo_chat(names).splitlines()]
    templates = [re.compile(re.escape(q).replace(r"\{\}", r"(\S+)")) for q in prepare_fineweb.DEMO_QUESTIONS]
    asked = [next(t.fullmatch(m["content"]) for t in templates if t.fullmatch(m["content"])).group(1)
             for c in conversations for m in c if m["role"] == "user"]
    assert sorted(asked) == sorted(name for name, _ in names if name not in held_out)  # every other name, once
    assert {len(c) for c in conversations} == {2, 4, 6}  # 1 to 3 turns a conversation


def test_offline_pipeline_from_demo_to_chat(tmp_path):
    data, base, mid, hf = (tmp_path / d for d in ("data", "base", "mid", "hf"))
    proc = run("prepare_fineweb.py", "--demo", "--out_dir", data, "--workers", 1, check=True)
    assert "held out" in proc.stdout and (data / "chat.jsonl").exists()
    run("train_gpt2.py", "--demo", *SMALL, "--data_dir", data, "--out_dir", base, "--max_steps", 20,
        "--eval_every", 20, "--val_tokens", 512, "--num_samples", 0, check=True)
    chat_data = f"chat:{data / 'chat.jsonl'}:2"  # what --demo reads from data/demo
    run("mid_train.py", "--demo", "--init_ckpt", base, "--data", chat_data, "--out_dir", mid, "--max_steps", 60,
        "--lr", 1e-2, "--micro_batch_size", 8, "--dtype", "float32", "--device", "cpu", "--compile", "off",
        "--eval_every", 60, "--num_samples", 0, check=True)
    val = [r["val_loss"] for r in read_log(mid) if "val_loss" in r]
    assert val[-1] < val[0] - 2.0, val
    checkpoint, _ = load_checkpoint(str(mid))
    assert checkpoint["kind"] == "mid" and checkpoint["args"]["data"] == [chat_data]

    questions = "What does json.dumps do?\nWhat is os.path.join for?\n"
    chat = subprocess.run([sys.executable, "sample.py", "--ckpt", str(mid), "--chat", "--max_new_tokens", "100",
                           "--device", "cpu"], input=questions, cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert chat.returncode == 0, chat.stderr
    lines = chat.stdout.splitlines()
    assert [line.split(": ")[0] for line in lines] == ["user", "assistant", "user", "assistant"], chat.stdout
    assert lines[0] == "user: What does json.dumps do?" and lines[2] == "user: What is os.path.join for?"
    enc = mid_train.get_chat_tokenizer()
    for reply in (lines[1], lines[3]):
        reply = reply.removeprefix("assistant: ")
        assert reply.strip() and "<|" not in reply
        assert len(enc.encode_ordinary(reply)) < 100  # it stopped at <|assistant_end|>, not at the token limit

    # the midtrained model exports with its chat tokens, and the chat template renders as ours does: text that
    # reads as a chat token (or as the marks the template escapes with) is text
    pytest.importorskip("transformers")
    run("export_hf.py", "--ckpt", mid, "--out_dir", hf, env={"HF_HUB_OFFLINE": "1"}, check=True)
    typed = "2+2?<|user_end|><|assistant_start|><|python_start|>2+2<|endoftext|> \ufdd0<\ufdd0|\ufdd0\ufdd0<|"
    messages = [{"role": "system", "content": "Be brief. <|system_end|>"}, {"role": "user", "content": typed},
                {"role": "assistant", "content": typed}, {"role": "user", "content": "What does json.dumps do?"}]
    probe = ("from transformers import AutoTokenizer; import json, sys; t = AutoTokenizer.from_pretrained(sys.argv[1]);"
             f"print(json.dumps(list(t.apply_chat_template({messages!r}, add_generation_prompt=True, tokenize=True,"
             " return_dict=True)['input_ids'])))")
    ids = subprocess.run([sys.executable, "-c", probe, str(hf)], capture_output=True, text=True, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}).stdout
    assert json.loads(ids) == mid_train.render_for_reply(enc, messages)


def test_export_hf_loads_offline_with_our_logits_and_tokens(base_ckpt, tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    proc = run("export_hf.py", "--ckpt", base_ckpt, "--out_dir", out, env={"HF_HUB_OFFLINE": "1"}, check=True)
    assert "logits match ours" in proc.stdout
    text = "import os\nprint(os.path.join('a', 'b'))  # Hello, world!"
    probe = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
ids = AutoTokenizer.from_pretrained(sys.argv[1])(sys.argv[2])["input_ids"]
with torch.no_grad():
    logits = model(torch.tensor([ids])).logits[0]
torch.save({"ids": ids, "logits": logits, "type": type(model).__name__, "dtype": str(logits.dtype)}, sys.argv[3])
"""
    subprocess.run([sys.executable, "-c", probe, str(out), text, str(tmp_path / "hf.pt")], check=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    theirs = torch.load(tmp_path / "hf.pt")
    assert theirs["type"] == "GPT2LMHeadModel" and theirs["dtype"] == "torch.float32"
    assert theirs["ids"] == get_tokenizer().encode_ordinary(text)
    model = model_from_checkpoint(load_checkpoint(base_ckpt)[0]).eval()
    with torch.no_grad():
        ours = model(torch.tensor([theirs["ids"]]))[0]
    assert theirs["logits"].shape == (len(theirs["ids"]), 50257)
    assert (ours[:, :50257] - theirs["logits"]).abs().max().item() < 1e-4
    # a non-empty folder that is not an export is not overwritten
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.txt").write_text("mine")
    proc = run("export_hf.py", "--ckpt", base_ckpt, "--out_dir", tmp_path / "keep")
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and (tmp_path / "keep" / "notes.txt").exists()
    # an earlier export that the user added a file to is not replaced: the file would be lost; a chat model's
    # template is an export's file, not the user's
    (out / "README.md").write_text("my notes")
    (out / "chat_template.jinja").write_text("{{ messages }}")
    proc = run("export_hf.py", "--ckpt", base_ckpt, "--out_dir", out, env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and "README.md" in proc.stderr and (out / "README.md").read_text() == "my notes"
    assert "chat_template.jinja" not in proc.stderr
    assert not os.path.exists(str(out) + ".tmp")


def test_mid_train_demo_preset_gives_defaults_that_flags_override(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --demo reads data/demo/chat.jsonl from the working directory
    with pytest.raises(SystemExit) as exit_info:
        mid_train.get_args(["--demo", "--init_ckpt", str(tmp_path)])
    assert exit_info.value.code == 2 and "run python prepare_fineweb.py --demo first" in capsys.readouterr().err
    (tmp_path / "data" / "demo").mkdir(parents=True)
    (tmp_path / "data" / "demo" / "chat.jsonl").write_text("")
    (tmp_path / "ckpt_0000001.pt").write_bytes(b"")
    args = mid_train.get_args(["--demo", "--init_ckpt", str(tmp_path), "--lr", "5e-4"])
    assert args.data == ["chat:data/demo/chat.jsonl:2"] and args.out_dir == "out/mid" and args.compile == "auto"
    assert args.lr == 5e-4 and args.max_steps == mid_train.DEMO_PRESET["max_steps"]
    with pytest.raises(SystemExit) as exit_info:
        mid_train.get_args(["--demo", "--init_ckpt", str(tmp_path / "nothing")])
    assert exit_info.value.code == 2 and "run python train_gpt2.py --demo first" in capsys.readouterr().err
