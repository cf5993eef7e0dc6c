import torch

import mid_train
import sample
from conftest import run
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
    tokens = list(generate(model, torch.randint(0, 50257, (1, 10)), 40, 50257, temperature=0))
    assert len(tokens) == 40


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
    for ckpt, expect in [(tmp_path / "nowhere", "no readable checkpoint at"), (tmp_path / "foreign.pt", "not a readable"),
                         (tmp_path / "other.pt", "not a train_gpt2.py/mid_train.py checkpoint")]:
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
