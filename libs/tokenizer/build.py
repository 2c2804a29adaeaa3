"""Build the tiny byte-level BPE tokenizer that tiny checkpoints ship, locally and deterministically."""

# Nothing is downloaded: BPE is trained with `tokenizers` on the fixed text in corpus.py, so every run
# writes the same bytes (the trainer breaks count ties by pair id, and the files are written with a
# fixed key order). The special tokens and the chat template follow DeepSeek-V3's: begin/end of
# sentence are ids 0 and 1 as in DeepSeek's config.json, `<｜User｜>`/`<｜Assistant｜>` are added
# non-special tokens (so `decode(skip_special_tokens=True)` keeps them, as DeepSeek's tokenizer does).

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from libs.tokenizer.corpus import CORPUS

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
ROLE_TOKENS = (USER_TOKEN, ASSISTANT_TOKEN)
VOCAB_SIZE = 1024
MODEL_MAX_LENGTH = 4096

# DeepSeek-V3's template: system prompts joined at the top after BOS, user turns after <｜User｜>, assistant
# turns closed with EOS (reasoning before </think> dropped). With `tools`, the function signatures follow
# the system prompt with the model's tool-call format; assistant tool calls and tool results use
# DeepSeek-V3's tool tokens (<｜tool▁calls▁begin｜> ... <｜tool▁outputs▁end｜>).
CHAT_TEMPLATE = r"""{%- if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}
{%- set ns = namespace(system_prompt='', is_first_sp=true, in_outputs=false) %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {%- if ns.is_first_sp %}
            {%- set ns.system_prompt = ns.system_prompt + message['content'] %}
            {%- set ns.is_first_sp = false %}
        {%- else %}
            {%- set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}{{ ns.system_prompt }}
{%- if tools %}
    {{- '\n\n## Tools\nYou can call these functions (JSON signatures):\n' }}
    {%- for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}
    {{- 'Call them as <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGUMENTS\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] != 'tool' and ns.in_outputs %}{{ '<｜tool▁outputs▁end｜>' }}{% set ns.in_outputs = false %}{% endif %}
    {%- if message['role'] == 'user' %}
        {{- '<｜User｜>' + message['content'] }}
    {%- elif message['role'] == 'assistant' %}
        {%- set content = message['content'] or '' %}
        {%- if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}
        {{- '<｜Assistant｜>' + content }}
        {%- if message['tool_calls'] %}
            {{- '<｜tool▁calls▁begin｜>' }}
            {%- for call in message['tool_calls'] %}
                {%- set args = call['function']['arguments'] %}
                {%- if args is not string %}{% set args = args | tojson %}{% endif %}
                {{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + call['function']['name'] + '\n```json\n' + args + '\n```<｜tool▁call▁end｜>' }}
            {%- endfor %}
            {{- '<｜tool▁calls▁end｜>' }}
        {%- endif %}
        {{- '<｜end▁of▁sentence｜>' }}
    {%- elif message['role'] == 'tool' %}
        {%- if not ns.in_outputs %}{{ '<｜tool▁outputs▁begin｜>' }}{% set ns.in_outputs = true %}{% endif %}
        {{- '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}
    {%- elif message['role'] != 'system' %}
        {{- raise_exception('Unsupported message role: ' + message['role']) }}
    {%- endif %}
{%- endfor %}
{%- if ns.in_outputs %}{{ '<｜tool▁outputs▁end｜>' }}{% endif %}
{%- if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"""


def train_tokenizer(vocab_size: int = VOCAB_SIZE, texts: Iterable[str] | None = None) -> Tokenizer:
    """Train the byte-level BPE on `texts` (default: CORPUS's paragraphs); the vocab holds every byte, so
    any text round-trips."""
    tok = Tokenizer(models.BPE())
    # DeepSeek-V3 splits digits in runs of up to three before the byte-level split.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ROLE_TOKENS),
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if texts is None:
        texts = [p for p in CORPUS.split("\n\n") if p.strip()]
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ROLE_TOKENS])
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def tokenizer_config(model_max_length: int = MODEL_MAX_LENGTH) -> dict:
    """tokenizer_config.json as transformers reads it (special tokens as AddedToken dicts, like DeepSeek's)."""

    def added(content: str) -> dict:
        return {
            "__type": "AddedToken",
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        }

    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": added(BOS_TOKEN),
        "eos_token": added(EOS_TOKEN),
        "pad_token": added(PAD_TOKEN),
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


def build_tokenizer(
    out_dir: str | Path,
    model_max_length: int = MODEL_MAX_LENGTH,
    *,
    vocab_size: int = VOCAB_SIZE,
    texts: Iterable[str] | None = None,
) -> Path:
    """Write tokenizer.json and tokenizer_config.json into out_dir (created if missing); return out_dir.
    `texts` and `vocab_size` as train_tokenizer takes them (the demo model trains on its own corpus)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size, texts)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    config = json.dumps(tokenizer_config(model_max_length), indent=2, ensure_ascii=False)
    (out / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
    return out
