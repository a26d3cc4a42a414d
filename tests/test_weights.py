"""Weight loading round trips: moshi-format checkpoints, transformers-format folders, random weights,
and the errors a checkpoint that does not fit gets (each names the tensor)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from mimi_code2wav.client.protocol import CODEBOOK_SIZE, NUM_CODEBOOKS, SAMPLE_RATE_HZ, SAMPLES_PER_FRAME

from mimi_fixtures import assert_equal_audio, snr_db, tiny_config

torch = pytest.importorskip("torch", reason="the export extra (torch) is needed for weight loading")
from safetensors.torch import load_file, save_file  # noqa: E402

from mimi_code2wav.export.weights import WeightsError, load_weights, random_model  # noqa: E402


def test_moshi_loads_the_checkpoint_and_both_decode_and_encode_alike(moshi_checkpoint, mimi):
    """The test checkpoint is one moshi itself loads (its own loader, strict); through our mapping it
    decodes the same audio, and the encoder weights map too (WAV -> codes): both pick the same codes."""
    from moshi.models.loaders import get_mimi

    moshi_model = get_mimi(str(moshi_checkpoint[0]), device="cpu", num_codebooks=NUM_CODEBOOKS)
    codes = torch.from_numpy(np.random.default_rng(0).integers(0, CODEBOOK_SIZE, (1, NUM_CODEBOOKS, 20)))
    audio = torch.from_numpy(np.random.default_rng(1).standard_normal((1, 1, SAMPLE_RATE_HZ)).astype(np.float32) * 0.1)
    with torch.no_grad():
        reference, ours = moshi_model.decode(codes)[0, 0].numpy(), mimi.model.decode(codes).audio_values[0, 0].numpy()
        moshi_codes = moshi_model.encode(audio).numpy()
        our_codes = mimi.model.encode(audio, num_quantizers=NUM_CODEBOOKS).audio_codes.numpy()
    assert mimi.kind == "moshi" and len(mimi.sha256) == 64
    assert_equal_audio(ours, reference, what="transformers MimiModel (mapped) vs moshi, offline decode")
    assert our_codes.shape == moshi_codes.shape == (1, NUM_CODEBOOKS, 13)
    assert (our_codes == moshi_codes).mean() > 0.95, (our_codes == moshi_codes).mean()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A transformers-format folder written by transformers' own save_pretrained."""
    model = random_model(3, tiny_config()).model
    folder = tmp_path_factory.mktemp("tiny_mimi")
    model.save_pretrained(str(folder))
    return folder, model


def test_transformers_folder_round_trip(tiny_dir):
    folder, source = tiny_dir
    loaded = load_weights(folder)
    assert loaded.kind == "transformers"
    codes = torch.from_numpy(np.random.default_rng(2).integers(0, 64, (2, 8, 12)))
    with torch.no_grad():
        expected = source.decode(codes).audio_values
        got = loaded.model.decode(codes).audio_values
    assert expected.std() > 0.05
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


FC1, RENAMED = "decoder_transformer.layers.1.mlp.fc1.weight", "decoder_transformer.layers.1.mlp.fc_1.weight"
UPSAMPLE = "upsample.conv.weight"


@pytest.mark.parametrize("moshi, edit, messages", [
    pytest.param(False, lambda t: t.pop("decoder.layers.0.conv.weight"),
                 ["missing tensors (1): decoder.layers.0.conv.weight"], id="missing"),
    pytest.param(False, lambda t: t.__setitem__(RENAMED, t.pop(FC1)),
                 [f"missing tensors (1): {FC1}", f"unexpected tensors (1): {RENAMED}"], id="renamed"),
    pytest.param(False, lambda t: t.__setitem__(UPSAMPLE, t[UPSAMPLE][:, :, :2].contiguous()),
                 [f"mis-shaped tensors (1): {UPSAMPLE}: checkpoint (64, 1, 2), model (64, 1, 4)"], id="misshaped"),
    pytest.param(True, lambda t: t.__setitem__("decoder.model.99.lstm.weight", torch.zeros(1)),
                 ["no known Mimi name: decoder.model.99.lstm.weight"], id="moshi-unknown"),
    pytest.param(True, lambda t: t.pop("decoder_transformer.transformer.layers.3.linear2.weight"),
                 ["missing tensors (1): decoder_transformer.layers.3.mlp.fc2.weight"], id="moshi-missing"),
])
def test_a_tensor_that_does_not_fit_is_named(request, tmp_path, moshi, edit, messages):
    """A transformers folder or a moshi checkpoint, one tensor edited: the error names it."""
    if moshi:
        source = tmp_path / "edited.safetensors"
        tensors = load_file(str(request.getfixturevalue("moshi_checkpoint")[0]))
    else:
        tiny = request.getfixturevalue("tiny_dir")[0]
        tensors, source = load_file(str(tiny / "model.safetensors")), tmp_path / "edited"
        source.mkdir()
        (source / "config.json").write_text((tiny / "config.json").read_text())
    edit(tensors)
    save_file(tensors, str(source if moshi else source / "model.safetensors"))
    with pytest.raises(WeightsError) as error:
        load_weights(source)
    for message in messages:
        assert message in str(error.value)


def test_bad_sources_fail_clearly(tmp_path, monkeypatch):
    with pytest.raises(WeightsError, match="no such file or folder"):
        load_weights(tmp_path / "nope.safetensors")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(WeightsError, match="only safetensors"):
        load_weights(tmp_path / "weights.bin")
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a safetensors file")
    with pytest.raises(WeightsError, match=f"{re.escape(str(broken))}: not a readable safetensors file"):
        load_weights(broken)
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="config.json is missing"):
        load_weights(tmp_path / "empty")
    with pytest.raises(WeightsError, match="no weights given"):
        load_weights(None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WeightsError, match="cannot get 'no-such-org/no-such-mimi'"):
        load_weights("no-such-org/no-such-mimi")


def test_random_weights_are_seeded_and_loud(capsys):
    a = load_weights(None, seed=4)
    assert "RANDOM weights" in capsys.readouterr().err
    b, c = load_weights(None, seed=4), load_weights(None, seed=5)
    assert a.sha256 == b.sha256 != c.sha256
    wa, wb, wc = (m.model.decoder.decoder_seanet.layers[0].conv.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    json.dumps(a.source)


def test_moshi_module_names_load_the_same_weights(moshi_checkpoint, mimi, tmp_path):
    """moshi's own module names (in_projs.0.weight) map exactly like the shipped ones (in_proj_weight)."""
    tensors = load_file(str(moshi_checkpoint[0]))
    assert any(name.endswith("self_attn.in_proj_weight") for name in tensors)
    renamed = {name.replace("self_attn.in_proj_weight", "self_attn.in_projs.0.weight")
               .replace("self_attn.out_proj.weight", "self_attn.out_projs.0.weight"): t for name, t in tensors.items()}
    save_file(renamed, str(tmp_path / "module-names.safetensors"))
    other = load_weights(tmp_path / "module-names.safetensors")
    for (name, a), (_, b) in zip(sorted(mimi.model.state_dict().items()), sorted(other.model.state_dict().items())):
        assert torch.equal(a, b), name


def test_rustymimi_reads_the_test_checkpoint(moshi_checkpoint, moshi_streams, scenario):
    """Kyutai's Rust Mimi reads the same file: it is in the shipped format, and decodes alike
    while the attention window is not yet full (its window semantics differ later)."""
    rustymimi = pytest.importorskip("rustymimi", reason="rustymimi is a test extra")
    tokenizer = rustymimi.Tokenizer(str(moshi_checkpoint[0]), num_codebooks=NUM_CODEBOOKS)
    codes = scenario.streams["A"][:, :20].astype(np.uint32)
    pcm = np.concatenate([np.asarray(tokenizer.decode_step(np.ascontiguousarray(codes[None, :, i : i + 1]))).reshape(-1) for i in range(20)])
    reference = moshi_streams["A"][: 20 * SAMPLES_PER_FRAME]
    assert pcm.shape == reference.shape
    assert snr_db(pcm, reference) > 60, snr_db(pcm, reference)
