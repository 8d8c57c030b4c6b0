"""The sinusoid position table in numpy, the same numbers as model.training.transformer.sinusoidal_positions."""

from __future__ import annotations

import math

import numpy as np


def sinusoid_table(max_len: int, d_model: int, layout: str, offset: int = 0) -> np.ndarray:
    """(max_len, D) float32 sines and cosines at geometrically spaced frequencies, row p for position p + offset.

    "interleaved": sin and cos of each frequency side by side, computed in float32 as the reference does.
    "halves": all sines, then all cosines, computed in float64 (transformers' Marian positions).
    "fairseq": all sines, then all cosines, frequencies spread over D/2 - 1 steps, computed in float32
    (transformers' M2M100 positions).
    """
    if layout == "fairseq":
        return fairseq_table(offset + max_len, d_model)[offset:]
    if offset:
        return sinusoid_table(offset + max_len, d_model, layout)[offset:]
    if layout == "halves":
        angle = np.arange(max_len, dtype=np.float64)[:, None] / np.power(
            10000.0, np.arange(0, d_model, 2, dtype=np.float64) / d_model
        )  # (max_len, D/2)
        return np.concatenate([np.sin(angle), np.cos(angle)], axis=1).astype(np.float32)
    position = np.arange(max_len, dtype=np.float32)[:, None]  # (max_len, 1)
    exponent = np.arange(0, d_model, 2, dtype=np.float32) * np.float32(-math.log(10000.0) / d_model)
    inv_freq = np.exp(exponent.astype(np.float64)).astype(np.float32)  # exp rounded once, as closely as torch
    table = np.zeros((max_len, d_model), dtype=np.float32)
    table[:, 0::2] = np.sin(position * inv_freq)
    table[:, 1::2] = np.cos(position * inv_freq)
    return table


def fairseq_table(rows: int, d_model: int) -> np.ndarray:
    """(rows, D) [sin | cos] with frequencies exp(-i log(10000) / (D/2 - 1)), a zero column where D is odd."""
    half = d_model // 2
    inv_freq = np.exp(np.arange(half, dtype=np.float32) * np.float32(-math.log(10000.0) / (half - 1)))  # (D/2,)
    angle = np.arange(rows, dtype=np.float32)[:, None] * inv_freq[None, :]  # (rows, D/2)
    table = np.concatenate([np.sin(angle), np.cos(angle)], axis=1)
    if d_model % 2:
        table = np.concatenate([table, np.zeros((rows, 1), dtype=np.float32)], axis=1)
    return table.astype(np.float32)
