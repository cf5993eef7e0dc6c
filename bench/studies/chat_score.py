"""
Does a midtrained demo model answer on topic about functions it was never trained on? `mid_train.py --demo` asks
"What does json.dumps do?" about the stdlib's documented functions but holds one name in 10 out (by a hash of the
name). This script asks N of those held-out names "What does NAME do?" (greedy, KV cache, up to <|assistant_end|>)
and scores each reply against the reference, the first sentence of the name's docstring:

- content words: lowercase alphanumeric runs of 2+ characters, minus English stop words and "return(s)" (which
  opens a third of all docstrings and so tells nothing about which function it is);
- on topic: the reply shares strictly more content words with its own reference than with the reference of another
  held-out name, drawn at random (seeded); a tie, 0-0 included, is off topic;
- on topic beyond the name: the same, counting only the reply's words that are not in the question, so that copying
  the name scores nothing (docstrings often repeat their function's name: get_content_type -> "Return the
  message's content type.");
- token F1: F1 of the reply's content words against the reference's, averaged over the questions.

The echo baseline, a "reply" that only repeats the question's name, shows how much copying the name alone gets.

    python bench/studies/chat_score.py --ckpt out/mid --num_questions 200
"""

import argparse
import collections
import os
import random
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import mid_train as mt  # noqa: E402
import prepare_fineweb  # noqa: E402  (the demo's names, and which are held out)
import sample  # noqa: E402  (generate: greedy with the KV cache)

STOP_WORDS = set("""a an and are as at be been but by can do does for from has have if in into is it its of on or so
such than that the their then there these this those to was were when which while will with would not no yes
you your we our return returns""".split())


def content_words(text):
    return [w for w in re.findall(r"[a-z0-9]{2,}", text.lower()) if w not in STOP_WORDS]


def overlap(reply, reference, leave_out=()):
    words = collections.Counter(w for w in content_words(reply) if w not in leave_out)
    return sum((words & collections.Counter(content_words(reference))).values())


def token_f1(reply, reference):
    common = overlap(reply, reference)
    if not common:
        return 0.0
    precision, recall = common / len(content_words(reply)), common / len(content_words(reference))
    return 2 * precision * recall / (precision + recall)


def score(replies, references, distractors, names):
    """(on topic, on topic beyond the name, mean token F1): shares of the replies, and the mean."""
    on_topic = beyond = f1 = 0
    for reply, reference, other, name in zip(replies, references, distractors, names):
        on_topic += overlap(reply, reference) > overlap(reply, other)
        name_words = set(content_words(name))
        beyond += overlap(reply, reference, name_words) > overlap(reply, other, name_words)
        f1 += token_f1(reply, reference)
    return on_topic / len(replies), beyond / len(replies), f1 / len(replies)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default="out/mid", help="a mid_train.py --demo checkpoint (file or out_dir)")
    p.add_argument("--num_questions", type=int, default=200, help="held-out names to ask about (0: all)")
    p.add_argument("--max_new_tokens", type=int, default=48, help="tokens per reply at most")
    p.add_argument("--examples", type=int, default=6, help="question/reply/reference triples to print")
    p.add_argument("--seed", type=int, default=0, help="which held-out names, and the distractors")
    p.add_argument("--device", default="cpu", help="cpu, cuda or mps (float32 weights)")
    args = p.parse_args()

    checkpoint, path = mt.load_checkpoint(args.ckpt)
    if checkpoint.get("kind") != "mid":
        mt.die(f"{path} is not a mid_train.py checkpoint; score one made by mid_train.py --demo")
    model = mt.model_from_checkpoint(checkpoint).to(args.device).eval()
    del checkpoint
    enc = mt.get_chat_tokenizer()
    stop = {enc.encode_single_token("<|assistant_end|>"), mt.EOT_TOKEN}

    _, names = prepare_fineweb.stdlib_texts()
    held_out = [(name, sentence) for name, sentence in names if prepare_fineweb.is_held_out(name)]
    rng = random.Random(args.seed)
    rng.shuffle(held_out)
    asked = held_out[: args.num_questions or None]
    distractors = [rng.choice([s for n, s in held_out if n != name and s != sentence]) for name, sentence in asked]

    replies, ended, t0 = [], 0, time.perf_counter()
    for name, _ in asked:
        prompt = mt.render_for_reply(enc, [{"role": "user", "content": f"What does {name} do?"}])
        reply = []
        for token in sample.generate(model, torch.tensor([prompt], device=args.device), args.max_new_tokens,
                                     enc.n_vocab, temperature=0):
            if token.item() in stop:
                ended += 1
                break
            reply.append(token.item())
        replies.append(enc.decode(reply))
    seconds = time.perf_counter() - t0

    names, references = [name for name, _ in asked], [sentence for _, sentence in asked]
    on_topic, beyond, f1 = score(replies, references, distractors, names)
    echo = score([name.replace(".", " ") for name in names], references, distractors, names)
    for name, reference, reply in list(zip(names, references, replies))[: args.examples]:
        print(f"Q: What does {name} do?\nA: {reply}\nreference: {reference}\n")
    print(f"checkpoint {path}: {len(asked)} held-out questions ({len(held_out)} held out in all) in {seconds:.0f} s; "
          f"{ended / len(asked):.1%} of the replies end within {args.max_new_tokens} tokens")
    print(f"on topic {on_topic:.1%} (echo baseline {echo[0]:.1%}) | on topic beyond the name {beyond:.1%} (echo "
          f"baseline {echo[1]:.1%}) | token F1 {f1:.3f} (echo baseline {echo[2]:.3f})")

if __name__ == "__main__":
    main()
