import io
import subprocess
import sys

import pytest
import torch

import mid_train
import sample
from conftest import REPO, run
from sample import GPT, GPTConfig, filter_logits, generate


def tiny_model(block_size=64):
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=block_size, n_layer=2, n_head=2, n_embd=32)).eval()


def test_greedy_generation_with_cache_equals_without():
    model = tiny_model()
    prompt = torch.randint(0, 50257, (2, 7))
    with_cache = torch.cat(list(generate(model, prompt, 50, 50257, temperature=0)), dim=1)
    without = torch.cat(list(generate(model, prompt, 50, 50257, temperature=0, use_cache=False)), dim=1)
    assert torch.equal(with_cache, without)
    # sampled with the same seed, the tokens agree too: a varied sequence, not one token repeated
    sampled = [torch.cat(list(generate(model, prompt, 50, 50257, generator=torch.Generator().manual_seed(1),
                                       use_cache=use_cache)), dim=1) for use_cache in (True, False)]
    assert torch.equal(*sampled) and len(set(sampled[0][0].tolist())) > 20


def test_generation_past_the_context_keeps_going():
    model = tiny_model(block_size=16)
    prompt = torch.randint(0, 50257, (1, 10))
    tokens = torch.cat(list(generate(model, prompt, 40, 50257, temperature=0)), dim=1)
    assert tokens.shape == (1, 40)
    # with and without the cache, the same tokens while prompt and sample fit in the context: the first 16 - 10 + 1
    without = torch.cat(list(generate(model, prompt, 40, 50257, temperature=0, use_cache=False)), dim=1)
    assert torch.equal(tokens[:, :7], without[:, :7])


def test_top_k_and_top_p_keep_exactly_the_right_tokens():
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]))
    kept = lambda out: set(torch.isfinite(out[0]).nonzero().flatten().tolist())  # noqa: E731
    assert kept(filter_logits(logits, top_k=2)) == {1, 3}
    assert kept(filter_logits(logits, top_p=0.7)) == {1, 3}  # 0.4 + 0.3 reaches 0.7
    assert kept(filter_logits(logits, top_p=0.71)) == {1, 3, 4}
    assert kept(filter_logits(logits, top_p=0.39)) == {1}
    assert kept(filter_logits(logits, top_k=3, top_p=0.95)) == {1, 3, 4}
    assert kept(filter_logits(logits)) == {0, 1, 2, 3, 4}


def test_chat_rendering_matches_mid_train():
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, who are you?"},
                    {"role": "assistant", "content": "A small GPT."}, {"role": "user", "content": "Thanks"}]
    enc = sample.get_chat_tokenizer()
    ids, mask = sample.render_conversation(enc, conversation)
    assert (ids, mask) == mid_train.render_conversation(mid_train.get_chat_tokenizer(), conversation)
    assert sample.render_for_reply(enc, conversation) == ids + [enc.encode_single_token("<|assistant_start|>")]
    assert enc.decode(ids) == ("<|bos|><|system_start|>Be brief.<|system_end|><|user_start|>Hi, who are you?"
                               "<|user_end|><|assistant_start|>A small GPT.<|assistant_end|><|user_start|>Thanks<|user_end|>")
    assert enc.decode([t for t, m in zip(ids, mask) if m]) == "A small GPT.<|assistant_end|>"


def test_same_seed_same_samples(base_ckpt):
    args = ["--ckpt", base_ckpt, "--prompt", "def main(", "--max_new_tokens", 20, "--num_samples", 2, "--device", "cpu",
            "--dtype", "float32"]
    a, b = run("sample.py", *args, check=True), run("sample.py", *args, check=True)
    c = run("sample.py", *args, "--seed", 7, check=True)
    assert a.stdout == b.stdout and a.stdout != c.stdout
    assert a.stdout.startswith("def main(") and a.stdout.count("-" * 40) == 1


def test_prompt_from_stdin_or_the_flag(base_ckpt, tmp_path):
    import subprocess
    import sys
    from conftest import REPO
    by_flag = run("sample.py", "--ckpt", base_ckpt, "--prompt", "class Foo:", "--max_new_tokens", 10, "--device", "cpu",
                  check=True)
    command = [sys.executable, "sample.py", "--ckpt", base_ckpt, "--max_new_tokens", "10", "--device", "cpu"]
    by_stdin = subprocess.run(command, input="class Foo:", cwd=REPO, capture_output=True, text=True)
    assert by_flag.stdout == by_stdin.stdout and by_flag.stdout.startswith("class Foo:")
    latin1 = subprocess.run(command, input="caf\xe9".encode("latin-1"), cwd=REPO, capture_output=True)
    lines = latin1.stderr.decode().strip().splitlines()
    assert latin1.returncode == 2 and len(lines) == 1 and "not UTF-8" in lines[0], lines


def test_missing_or_foreign_checkpoint_is_a_one_line_error(tmp_path):
    (tmp_path / "foreign.pt").write_bytes(b"not a checkpoint")
    torch.save({"weights": torch.zeros(3)}, tmp_path / "other.pt")
    for ckpt, expect in [(tmp_path / "nowhere", "no readable checkpoint at"), (tmp_path / "foreign.pt", "no readable checkpoint at"),
                         (tmp_path / "other.pt", "no readable checkpoint at")]:
        proc = run("sample.py", "--ckpt", ckpt)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and expect in lines[0], proc.stderr


def test_cpu_decoding_uses_one_thread_unless_omp_num_threads_is_set(base_ckpt):
    import os
    import subprocess
    import sys
    from conftest import REPO
    cmd = [sys.executable, "sample.py", "--ckpt", base_ckpt, "--prompt", "x", "--max_new_tokens", "2", "--device", "cpu"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torch would use every core
    default = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    told = subprocess.run(cmd, cwd=REPO, env={**env, "OMP_NUM_THREADS": "2"}, capture_output=True, text=True)
    assert "cpu threads: 1 " in default.stderr and "cpu threads" not in told.stderr, (default.stderr, told.stderr)


def test_calculator_evaluates_arithmetic_and_refuses_anything_else():
    cases = {"48/2": "24", "12/60": "0.2", "1,000*3 - 2**10": "1976", "-(7 // 2) % 5": "2", "(1 + 2) * -3": "-9",
             "'strawberry'.count('r')": "3",  # the letter count SpellingBee teaches
             # commas are dropped between thousands only, never inside a string
             "2,500 + 1,000,000": "1002500", "'a,b'.count(',')": "1", "'1,000'.count(',')": "1",
             '"x,,y".count(",")': "2"}
    assert {text: sample.calculate(text) for text in cases} == cases
    for text in ["1,0000", "1,2", "__import__('os').system('echo hacked')", "open('/etc/passwd').read()", "x + 1", "print(1)",
                 "(lambda: 1)()", "[1] * 3", "'a' * 3", "abs(-1)", "2 if 1 else 3", "'ab'.count(__name__)",
                 "9**9**9", "10**40", "1e999", "1/0", "(-8) ** 0.5", "1 +" * 100 + "1", ""]:
        assert sample.calculate(text) is None, text  # parsed, never run: nothing but arithmetic, bounded


def test_chat_runs_the_models_calculator_call_and_the_model_reads_on_from_its_result(monkeypatch, capsys):
    enc = sample.get_chat_tokenizer()
    inputs = []

    def generate_from(ids, max_new_tokens):
        """A stub model: it calls the calculator, then answers with the tool's output it reads."""
        inputs.append(enc.decode(ids))
        question = inputs[-1].rpartition("<|user_start|>")[2]
        if inputs[-1].endswith("<|output_end|>"):
            text = f"{inputs[-1].rpartition('<|output_start|>')[2][:-len('<|output_end|>')]} clips.<|assistant_end|>"
        elif inputs[-1].endswith("<|python_end|>"):  # a call that got no output
            text = " done.<|assistant_end|>"
        elif "import" in question:  # a call of model text that is not arithmetic
            text = "Let me see: <|python_start|>__import__('os').getcwd()<|python_end|>"
        else:
            text = "Half of 48 is <|python_start|>48/2<|python_end|>"
        return (torch.tensor([[token]]) for token in enc.encode(text, allowed_special="all"))

    monkeypatch.setattr(sys, "stdin", io.StringIO("How many is half of 48 clips?\nimport os please\n"))
    sample.chat(enc, generate_from, 100)
    out, err = capsys.readouterr()
    call = "<|python_start|>48/2<|python_end|><|output_start|>24<|output_end|>"
    assert f"assistant: Half of 48 is {call}24 clips.\n" in out
    assert inputs[1].endswith(f"<|assistant_start|>Half of 48 is {call}")  # the model read the tool's output
    # the second turn follows the first as the model wrote it; the refused call gets no output
    assert inputs[2].endswith(f"{call}24 clips.<|assistant_end|><|user_start|>import os please<|user_end|>"
                              f"<|assistant_start|>")
    assert "assistant: Let me see: <|python_start|>__import__('os').getcwd()<|python_end|> done.\n" in out
    assert len(inputs) == 4 and "<|output_start|>" not in inputs[3].rpartition("<|user_start|>")[2]
    assert "not arithmetic" in err


def test_piped_chat_answers_every_question_and_refuses_input_that_is_not_utf8(monkeypatch, capsys):
    enc = sample.get_chat_tokenizer()
    generate_from = lambda ids, max_new_tokens: iter([torch.tensor([[enc.encode_single_token("<|assistant_end|>")]])])
    monkeypatch.setattr(sys, "stdin", io.StringIO("first?\n\n  \nsecond?\n"))  # blank lines between questions
    sample.chat(enc, generate_from, 10)
    assert capsys.readouterr().out == "user: first?\nassistant: \nuser: second?\nassistant: \n"
    # in a C locale, stdin reads the byte 0xe9 of Latin-1's "café" as a lone surrogate
    monkeypatch.setattr(sys, "stdin", io.StringIO("caf\udce9?\n"))
    with pytest.raises(SystemExit) as exit_info:
        sample.chat(enc, generate_from, 10)
    assert exit_info.value.code == 2 and "error: a line on stdin is not UTF-8" in capsys.readouterr().err


def test_a_checkpoint_made_before_the_calculators_tokens_loads_and_chats(tmp_path):
    # A model that would write a calculator token whenever it could: every position's output is ones, and only
    # the embeddings of the tokens after the 7 chat tokens of the older checkpoints are not zeros.
    model = tiny_model()
    old_tokens = sample.CHAT_TOKENS[:7]
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.transformer.wte.weight.zero_()
        model.transformer.wte.weight[50257 + len(old_tokens):].fill_(1.0)
    torch.save({"model": model.state_dict(), "config": vars(model.config), "kind": "mid", "step": 10,
                "chat_tokens": old_tokens}, tmp_path / "ckpt_0000010.pt")
    chat = subprocess.run([sys.executable, "sample.py", "--ckpt", str(tmp_path), "--chat", "--temperature", "0",
                           "--max_new_tokens", "5", "--device", "cpu"], input="What is 2+2?\n", cwd=REPO,
                          capture_output=True, text=True)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout == "user: What is 2+2?\nassistant: !!!!!\n"  # token 0, never one it was not trained with
