"""The fixed training text for the built-in tiny tokenizer (see build.py)."""

# Hand-written English prose, Python, JSON and shell, so the merges look like a real tokenizer's
# (common words, indentation, punctuation) while the whole thing stays a few KB. Changing one character
# changes the tokenizer and every tiny checkpoint made from it, so edit only on purpose.

CORPUS = r'''
The model reads a prompt, one token at a time, and writes the next token. A serving system keeps many
such conversations in flight at once. It batches the work of every request into one forward pass, so
the accelerator stays busy, and it keeps the attention cache of every request in pages of fixed size.
When a request finishes, its pages go back to the pool, and a new request can take them at once.

Prefill and decode are different kinds of work. Prefill reads the whole prompt in one pass and is
limited by arithmetic; decode writes one token per step for each request and is limited by memory
bandwidth. Running them on separate machines lets each side use the batch size that suits it. The
prefill worker computes the cache for the prompt, then sends it to the decode worker over the network.

A mixture of experts replaces the dense feed-forward block with many small experts. A router picks a
few experts for each token, so the model has many parameters but each token uses only a small part of
them. With expert parallelism, the experts live on different devices, and tokens travel to the device
that holds their expert, and back again, in two all-to-all exchanges called dispatch and combine.

Multi-head latent attention stores one compressed row per token instead of a key and a value for every
head. The row holds a latent vector and a small rotary key. At decode time, the query is projected into
the latent space, so the cache never needs to be expanded. This saves memory and bandwidth, which is
what limits the speed of decoding long sequences.

Good software is easy to read. Each module does one thing, and its name says what. Functions are
short. Errors say what went wrong and how to fix it. Tests check real behaviour, run fast, and fail
when the code is broken. The documentation tells a new reader where to start and what to run first.

Questions and answers:
Q: What is the capital of France? A: The capital of France is Paris.
Q: How many days are there in a week? A: There are seven days in a week.
Q: What is two plus three? A: Two plus three is five.
Q: Who wrote this program? A: A small team of engineers wrote it together, one file at a time.
Q: Why is the sky blue? A: Air scatters blue light more than red light, so the sky looks blue.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 16 32 64 128 256 512 1024 2048 4096 8192 2025 3.14159 2.71828.
Time: 12:30, 09:45, 2025-06-01. Money: $10, $2.50, 100 USD. Percent: 50%, 99.9%.

def softmax(logits, temperature=1.0):
    """Return the probabilities of a list of logits."""
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    total = sum(weights)
    return [w / total for w in weights]


class PagePool:
    """A free list of fixed-size pages."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.free = list(range(num_pages))

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            raise RuntimeError(f"out of pages: need {count}, have {len(self.free)}")
        pages, self.free = self.free[:count], self.free[count:]
        return pages

    def release(self, pages: list[int]) -> None:
        self.free.extend(pages)


def greedy(model, tokens: list[int], max_tokens: int = 16) -> list[int]:
    output = []
    for _ in range(max_tokens):
        logits = model(tokens + output)
        next_token = int(logits[-1].argmax())
        output.append(next_token)
        if next_token == model.eos_token_id:
            break
    return output


for i in range(10):
    print(i, i * i, "even" if i % 2 == 0 else "odd")

import json
import math
import os
from pathlib import Path

config = {"hidden_size": 128, "num_layers": 3, "vocab_size": 1024, "use_cache": true, "name": "tiny"}
request = {"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "stream": true}
response = {"id": "chat-1", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop"}]}

$ python -m pytest -q tests/
$ git commit -m "Add the page pool" -- libs/pool.py
$ export PATH="$HOME/.local/bin:$PATH"
$ curl -s http://127.0.0.1:8000/v1/models | python -m json.tool

The quick brown fox jumps over the lazy dog. The five boxing wizards jump quickly. Pack my box with
five dozen liquor jugs. How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.

Hello! How are you today? I am fine, thank you. Can you help me with a question? Of course, what would
you like to know? I would like to know how the weather will be tomorrow. It will be sunny and warm,
with a light wind from the west. Thank you very much! You are welcome. Have a nice day.

Once upon a time, there was a little robot who lived in a quiet town by the sea. Every morning, the
robot walked to the harbour and counted the boats. Some days there were ten boats, and some days there
were twelve. One day, the robot counted only three boats, and it wondered where the others had gone.
It asked the old fisherman, who smiled and said that a storm was coming, and the wise sailors had
stayed at home. The robot went home too, and listened to the rain on the roof until it fell asleep.
Multilingual lines, so that some merges join the bytes of characters outside ASCII:
你好，世界！今天天气很好。我们一起去公园散步吧。你好，朋友！今天我们学习语言模型。
こんにちは、世界。今日はいい天気ですね。こんにちは、お元気ですか。ありがとうございます。
안녕하세요, 세계. 감사합니다. 안녕하세요, 친구.
Привет, мир! Как дела? Спасибо, хорошо. Привет, друг!
Grüße aus München! Ça va très bien, merci. ¿Dónde está la estación? Él está aquí. Café, naïve, déjà vu.
Emoji: 🙂 😀 🚀 ✨ 👍 🎉 🙂 😀 🚀 ✨ 👍 🎉 ❤️ ✅ ❌ 🔥 🙂 🚀 👍

The scheduler keeps a queue of waiting requests and a list of running ones. At every step it decides
which requests to run: first the running requests that still need tokens, then new requests from the
queue, as long as there are free pages and the batch is not full. A request that cannot get a page
waits in the queue. A request that has produced its last token, or has hit a stop string, or has been
cancelled by the client, leaves the batch and gives its pages back. The scheduler never blocks: every
wait has a deadline, and a request whose deadline passes ends with a clear error.

The gateway speaks the same protocol as the most common chat services. A client sends a list of
messages, each with a role and some content, and the gateway turns them into a prompt with the chat
template of the model. It counts the tokens, checks the limits, and sends the request on. The tokens
come back as a stream; the gateway turns them into text, piece by piece, and sends each piece to the
client as soon as it is ready. When the stream ends, it reports why it ended and how many tokens it used.

async def stream_tokens(client, request_id: str, timeout: float = 30.0):
    """Yield the text of each new chunk until the request finishes."""
    async with client.subscribe(f"mesh.stream.{request_id}") as subscription:
        while True:
            message = await asyncio.wait_for(subscription.next(), timeout)
            chunk = decode(message.data)
            if chunk.text:
                yield chunk.text
            if chunk.finish_reason is not None:
                return


def test_pool_allocates_and_releases():
    pool = PagePool(num_pages=4, page_size=16)
    pages = pool.allocate(3)
    assert len(pages) == 3
    assert len(pool.free) == 1
    pool.release(pages)
    assert len(pool.free) == 4
    with pytest.raises(RuntimeError, match="out of pages"):
        pool.allocate(5)
'''
