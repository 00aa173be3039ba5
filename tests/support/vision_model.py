"""A tiny vision tower with random weights that llama.cpp's multimodal loader accepts for the
embedded text model: a test stand-in for a real vision model, which cannot be downloaded here.

Its answers are meaningless; the path is real: llama-server loads the mmproj, encodes the image
with it and counts the image's tokens into the prompt. LLaVA layout ("mlp" projector): a ViT of
two blocks over 8-px patches of a 32-px image (16 patches → 16 image tokens), then a two-layer
MLP into the text model's embedding width.

    python -m tests.support.vision_model FOLDER    # writes FOLDER/model.gguf and FOLDER/mmproj.gguf
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import gguf
import numpy as np

from llmserver.models.files import embedded_model_path

IMAGE_SIZE = 32
PATCH_SIZE = 8
WIDTH = 64
FFN = 128
LAYERS = 2
HEADS = 4
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2


def text_width(model: Path) -> int:
    reader = gguf.GGUFReader(model)
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    field = reader.fields[f"{architecture}.embedding_length"]
    return int(field.parts[-1][0])


def write_mmproj(path: Path, text_embedding: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    def zeros(n: int) -> np.ndarray:
        return np.zeros(n, dtype=np.float32)

    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("general.name", "llmserver test vision tower (random weights)")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    writer.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    writer.add_uint32("clip.vision.embedding_length", WIDTH)
    writer.add_uint32("clip.vision.feed_forward_length", FFN)
    writer.add_uint32("clip.vision.block_count", LAYERS)
    writer.add_uint32("clip.vision.projection_dim", text_embedding)
    writer.add_uint32("clip.vision.attention.head_count", HEADS)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])

    # numpy shapes are ggml's ne reversed: a linear map in → out is (out, in).
    writer.add_tensor("v.patch_embd.weight", weights(WIDTH, 3, PATCH_SIZE, PATCH_SIZE))
    writer.add_tensor("v.patch_embd.bias", zeros(WIDTH))
    writer.add_tensor("v.position_embd.weight", weights(IMAGE_TOKENS, WIDTH))
    writer.add_tensor("v.pre_ln.weight", ones(WIDTH))
    writer.add_tensor("v.pre_ln.bias", zeros(WIDTH))
    for layer in range(LAYERS):
        block = f"v.blk.{layer}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(f"{block}.{name}.weight", weights(WIDTH, WIDTH))
            writer.add_tensor(f"{block}.{name}.bias", zeros(WIDTH))
        for name in ("ln1", "ln2"):
            writer.add_tensor(f"{block}.{name}.weight", ones(WIDTH))
            writer.add_tensor(f"{block}.{name}.bias", zeros(WIDTH))
        writer.add_tensor(f"{block}.ffn_up.weight", weights(FFN, WIDTH))
        writer.add_tensor(f"{block}.ffn_up.bias", zeros(FFN))
        writer.add_tensor(f"{block}.ffn_down.weight", weights(WIDTH, FFN))
        writer.add_tensor(f"{block}.ffn_down.bias", zeros(WIDTH))
    writer.add_tensor("mm.0.weight", weights(text_embedding, WIDTH))
    writer.add_tensor("mm.0.bias", zeros(text_embedding))
    writer.add_tensor("mm.2.weight", weights(text_embedding, text_embedding))
    writer.add_tensor("mm.2.bias", zeros(text_embedding))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_vision_model(folder: Path) -> tuple[Path, Path]:
    """The embedded text model as `model.gguf`, with a matching `mmproj.gguf` beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    model = folder / "model.gguf"
    shutil.copyfile(embedded_model_path(), model)
    mmproj = folder / "mmproj.gguf"
    write_mmproj(mmproj, text_width(model))
    return model, mmproj


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.support.vision_model FOLDER")
    for written in write_vision_model(Path(sys.argv[1])):
        print(written)
