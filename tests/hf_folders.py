"""Tiny Hugging Face model folders the tests build themselves (random weights, `save_pretrained`): a BERT-style
sentence-transformers embedder, a BERT cross-encoder (one label), a BERT sequence classifier (several labels,
single- or multi-label) and a Llama-style causal LM with a chat template. Hidden size 32, 2 layers: built and
loaded in well under a second each."""

from __future__ import annotations

from pathlib import Path

WORDS = (
    "the a an is are was of to and in on for with that this it as be by at from or not but what which who "
    "how why when where cat dog fish bird tree house car road city river sea sky sun moon star rain snow "
    "red blue green big small fast slow good bad new old hot cold eat run jump swim fly read write sing "
    "play think know see hear hello world question answer model vector text search rank query document "
    "paris france capital food man woman guitar music"
).split()

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def wordpiece_tokenizer(max_length: int = 128):
    """A BERT fast tokenizer over WORDS (WordPiece, lower case), as `BertTokenizerFast`."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = sorted(set("".join(WORDS)) | set("0123456789.,?!'"))
    # one id per token: a letter that is also a word ("a") is listed twice, and ids must stay below len(vocab)
    tokens = dict.fromkeys(specials + list(WORDS) + letters + ["##" + c for c in letters])
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return BertTokenizerFast(
        tokenizer_object=tok,
        model_max_length=max_length,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def bert_config(tokenizer, **extra):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        **extra,
    )


def embedder(
    folder: Path,
    pooling: str = "mean",
    normalize: bool = True,
    max_seq_length: int = 64,
    initializer_range: float | None = None,
) -> Path:
    """A sentence-transformers embedder (Transformer, Pooling, and Normalize when `normalize`), saved.
    `initializer_range`: BERT's own default (0.02) unless given; wider weights make int8's error measurable."""
    import torch
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    except ImportError:  # sentence-transformers before 6
        from sentence_transformers.models import Normalize, Pooling, Transformer
    from transformers import BertModel

    torch.manual_seed(0)
    tokenizer = wordpiece_tokenizer()
    raw = folder.parent / (folder.name + "-raw")
    extra = {} if initializer_range is None else {"initializer_range": initializer_range}
    BertModel(bert_config(tokenizer, **extra)).save_pretrained(raw)
    tokenizer.save_pretrained(raw)
    modules = [Transformer(str(raw), max_seq_length=max_seq_length), Pooling(32, pooling_mode=pooling)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


def cross_encoder(folder: Path) -> Path:
    """A BERT cross-encoder: BertForSequenceClassification with one label, saved with its tokenizer."""
    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(1)
    tokenizer = wordpiece_tokenizer()
    BertForSequenceClassification(bert_config(tokenizer, num_labels=1)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def classifier(
    folder: Path,
    labels: tuple[str, ...] = ("negative", "neutral", "positive"),
    multi_label: bool = False,
    initializer_range: float = 0.5,
) -> Path:
    """A BERT sequence classifier built from its config (`from_config`, random weights) with these `id2label`
    names; `multi_label`: `problem_type: multi_label_classification` (scored with sigmoid, not softmax). Saved
    with its tokenizer. Weights of the default range give logits far enough apart that the scores differ visibly,
    and a network so chaotic that int8 weights change its classes; 0.15 keeps them under int8."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(3)
    tokenizer = wordpiece_tokenizer()
    config = bert_config(
        tokenizer,
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
        problem_type="multi_label_classification" if multi_label else "single_label_classification",
        initializer_range=initializer_range,
    )
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def byte_bpe_tokenizer():
    """A byte-level BPE fast tokenizer trained on WORDS, with the chat template's special tokens."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def causal_lm(folder: Path, architecture: str = "llama", generation: dict | None = None) -> Path:
    """A Llama-style causal LM (random weights) with a chat template, saved with its tokenizer and a
    generation_config.json (`generation`: its sampling defaults)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    tokenizer = byte_bpe_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **(generation or {})
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
