"""A real judge for tests: an OpenAI-compatible chat server that runs a causal LM from a local directory.

    python -m testing.judge_server MODEL_DIR --port 8123 --log requests.jsonl

``POST /v1/chat/completions`` applies the tokenizer's chat template when it has one (else the last user
message is the prompt), generates greedily up to ``max_tokens`` with transformers, and answers in the
OpenAI response shape. Every request is appended to ``--log`` (path, Authorization header, model,
temperature, the prompt and the answer), so a test can audit what the judge was asked and by whom.

``train_answering_model`` makes a model worth asking: a tiny GPT-2 trained (seconds, on the CPU) on the
judge's own question to give one answer — so a test can plant a judge that finds text fluent and see the
verdict follow it through the real client, server, prompt and parser.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from services.runner.judges import QUESTION
from testing.tiny_models import ENGLISH, build_tokenizer


def train_answering_model(out_dir: Path, answer: str, steps: int = 200, seed: int = 0) -> Path:
    """A tiny GPT-2 that answers QUESTION about any text with ``answer``, saved with its tokenizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    torch.set_num_threads(1)  # a model this small trains fastest on one thread, and shares the machine
    rng = random.Random(seed)
    tokenizer = build_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=512,
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    model = GPT2LMHeadModel(config)
    words = ENGLISH.split()

    def example() -> list[int]:
        text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 40)))
        if rng.random() < 0.5:  # garbage too: the answer must not depend on the text
            text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(rng.randint(5, 160)))
        prompt = tokenizer(QUESTION.format(text=text))["input_ids"]
        return prompt + tokenizer(" " + answer)["input_ids"] + [tokenizer.eos_token_id]

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = [example() for _ in range(8)]
        width = max(len(ids) for ids in batch)
        ids = torch.tensor([b + [tokenizer.eos_token_id] * (width - len(b)) for b in batch])
        labels = torch.tensor([b + [-100] * (width - len(b)) for b in batch])
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


class JudgeServer:
    """The server around one model; ``serve`` blocks."""

    def __init__(self, model_dir: Path, log: Path | None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.log = log
        self.lock = threading.Lock()  # one generation at a time; the log's lines never interleave

    def complete(self, body: dict[str, Any]) -> str:
        import torch

        messages = body["messages"]
        if self.tokenizer.chat_template:
            prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            prompt = messages[-1]["content"]
        ids = self.tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = self.model.generate(**ids, do_sample=False, max_new_tokens=int(body.get("max_tokens") or 60),
                                      pad_token_id=self.tokenizer.eos_token_id)  # fmt: skip
        return self.tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()

    def handle(self, path: str, auth: str | None, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            answer = self.complete(body)
            if self.log:
                entry = {"path": path, "auth": auth, "model": body.get("model"), "temperature": body.get("temperature"),
                         "prompt": body["messages"][-1]["content"], "answer": answer}  # fmt: skip
                with self.log.open("a") as f:
                    f.write(json.dumps(entry) + "\n")
        return {
            "object": "chat.completion",
            "model": body.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}],
        }

    def serve(self, port: int) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self.send_error(404)
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                payload = json.dumps(server.handle(self.path, self.headers.get("Authorization"), body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self) -> None:  # readiness: the model is loaded once the port answers
                payload = json.dumps({"object": "list", "data": [{"id": "judge", "object": "model"}]}).encode()
                self.send_response(200 if self.path.rstrip("/") == "/v1/models" else 404)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testing.judge_server", description=__doc__)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--log", type=Path)
    args = parser.parse_args(argv)
    JudgeServer(args.model_dir, args.log).serve(args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
