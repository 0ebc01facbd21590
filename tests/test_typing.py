"""The declared edges (tierstore.typing, tierstore.io.Backend) describe what the code accepts at run time:
every codec the store takes is a Codec, every value put() takes is TensorLike, and both I/O backends are
Backends that implement what the protocol requires and inherit only what it marks optional."""
from __future__ import annotations

import numcodecs
import numpy as np
import pytest
import torch

from tierstore.encoding import IDENTITY
from tierstore.io import Backend, Engine, io_uring_status
from tierstore.io.engine import _ThreadBackend, _UringBackend
from tierstore.quant import codec_for
from tierstore.tiers.device import to_dlpack_tensor
from tierstore.typing import Codec, SupportsDLPack, TensorLike


class _Producer:
    """A DLPack producer that is neither a torch tensor nor a numpy array (as cupy or jax arrays are)."""

    def __init__(self, t: torch.Tensor):
        self._t = t

    def __dlpack__(self, *args, **kwargs):
        return self._t.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


class _EncodeOnly:
    def encode(self, buf):
        return buf


@pytest.mark.parametrize("codec", [IDENTITY, numcodecs.Zstd(level=1), numcodecs.Blosc(), codec_for("int8"),
                                   codec_for("dyn8v", 128, torch.bfloat16)], ids=repr)
def test_the_codecs_the_store_takes_are_codecs(codec):
    assert isinstance(codec, Codec)
    assert codec is IDENTITY or numcodecs.get_codec(codec.get_config()).get_config() == codec.get_config()


@pytest.mark.parametrize("obj", [_EncodeOnly(), "zstd", {"id": "zstd"}, None])
def test_what_is_not_a_codec(obj):
    assert not isinstance(obj, Codec)


@pytest.mark.parametrize("make", [lambda x: x, lambda x: x.numpy(), _Producer], ids=["torch", "numpy", "dlpack"])
def test_tensor_like_values_are_what_put_accepts(make):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    value = make(x)
    assert isinstance(value, TensorLike)
    assert torch.equal(to_dlpack_tensor(value), x)


def test_a_dlpack_producer_needs_both_methods():
    assert isinstance(_Producer(torch.zeros(1)), SupportsDLPack)
    assert not isinstance(_EncodeOnly(), SupportsDLPack)
    assert not isinstance([1.0, 2.0], TensorLike)  # a list is refused by put(), and is not TensorLike


_REQUIRED = ("submit_many", "close")  # the protocol's bodies are `...`: a backend must define them
_OPTIONAL = ("register_buffers", "register_file", "unregister_file")  # the protocol's bodies are the defaults


@pytest.mark.parametrize("cls", [_ThreadBackend, _UringBackend])
def test_backends_define_what_the_protocol_requires(cls):
    assert Backend in cls.__mro__  # declared, so mypy checks it against the protocol
    for name in _REQUIRED:
        assert getattr(cls, name) is not getattr(Backend, name), f"{cls.__name__}.{name} is the protocol's stub"


def test_the_thread_backend_takes_the_optional_defaults(tmp_path):
    for name in _OPTIONAL:
        assert getattr(_ThreadBackend, name) is getattr(Backend, name), name  # no stubs of its own
    with Engine(backend="threads") as eng:
        assert eng.backend == "threads"
        # the backend object is the engine's own: no public surface answers what its defaults return
        assert eng._backend.register_buffers([(4096, 4096)]) is False
        f = eng.open(tmp_path / "x.bin")  # register_file: the default does nothing
        eng.write(f, np.arange(1024, dtype=np.float32), 0).result()
        out = np.empty(1024, np.float32)
        eng.read(f, out, 0).result()
        assert f.slots == {}
        eng.close_file(f)  # unregister_file: the default does nothing
    np.testing.assert_array_equal(out, np.arange(1024, dtype=np.float32))


@pytest.mark.skipif(not io_uring_status()[0], reason="io_uring unavailable here")
def test_the_uring_backend_overrides_every_optional_member():
    for name in _OPTIONAL:
        assert getattr(_UringBackend, name) is not getattr(Backend, name), name
    with Engine(backend="io_uring") as eng:
        assert eng._backend.faults is eng._backend  # the ring injects its own faults (an internal seam)
