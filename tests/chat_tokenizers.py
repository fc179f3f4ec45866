"""Tokenizers for the chat-template tests, built locally (no hub): byte-level BPE in Qwen2.5's, Qwen3's and Llama
3.1's layout carrying their published chat templates (tests/data/chat_templates/), and the adder tool's schema.

Imported as ``from chat_tokenizers import ...`` (tests/ is on sys.path, see checks.py).
"""

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.utils import get_json_schema

from fastgrpo.models.loading import build_tiny_tokenizer

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
# Qwen2's pre-tokenizer split (Llama 3's differs only in grouping digits by up to three)
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
LLAMA_SPLIT = QWEN_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>"]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


TOOLS = [get_json_schema(add)]
CORPUS = ["The quick brown fox answers the question, then the next one.\n\n",
          '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>\n',
          "<tool_response>\n42\n</tool_response>\n", "Given the following functions, please respond with a JSON"]


def bpe_tokenizer(template: str, specials: list[str], added: list[str], eos: str, split: str, bos: str | None = None):
    """A byte-level BPE tokenizer in Qwen's / Llama's layout (split regex, byte-level alphabet, special tokens, added
    tokens such as ``<tool_call>``), trained here on a small corpus (~600 tokens: merges such as ``\\n\\n`` exist, so
    piece boundaries are exercised), carrying ``template``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.add_tokens(added)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos, chat_template=template)


def published(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


def qwen25():
    return bpe_tokenizer(published("qwen2_5"), QWEN_SPECIALS, ["<tool_call>", "</tool_call>"], "<|im_end|>",
                         QWEN_SPLIT)


def qwen3(template: str | None = None):
    added = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
    return bpe_tokenizer(template or published("qwen3"), QWEN_SPECIALS, added, "<|im_end|>", QWEN_SPLIT)


def llama31():
    return bpe_tokenizer(published("llama3_1"), LLAMA_SPECIALS, [], "<|eot_id|>", LLAMA_SPLIT,
                         bos="<|begin_of_text|>")


TOKENIZERS = {"tiny": build_tiny_tokenizer, "qwen2.5": qwen25, "qwen3": qwen3, "llama3.1": llama31}
BUILT = {}


def tokenizer(name: str):
    if name not in BUILT:
        BUILT[name] = TOKENIZERS[name]()
    return BUILT[name]


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]
