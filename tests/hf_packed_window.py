"""A tiny transformers model whose attention makes a packed call with a sliding window (cu_seq_lens and
sliding_window to transformers' attention interface), as a new release might: a call dzc's attention cannot compute
as the model's own implementation does. Its own module, so that its code does not compare the implementation's name
(dzc.hf_attention leaves such models alone; a test file's asserts would)."""

import torch
import transformers
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


class PackedWindowConfig(transformers.PretrainedConfig):
    model_type = "dzc_test_packed_window"

    def __init__(self, hidden_size=16, heads=2, window=4, **kwargs):
        self.hidden_size, self.heads, self.window = hidden_size, heads, window
        super().__init__(**kwargs)


class PackedWindowModel(transformers.PreTrainedModel):
    config_class = PackedWindowConfig
    _supports_sdpa = True
    is_causal = False
    num_key_value_groups = 1

    def __init__(self, config):
        super().__init__(config)
        self.qkv = torch.nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out = torch.nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden, cu_seqlens):
        tokens, head_dim = hidden.shape[0], self.config.hidden_size // self.config.heads
        q, k, v = self.qkv(hidden).view(tokens, 3, self.config.heads, head_dim).permute(1, 2, 0, 3)[:, None].unbind(0)
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        attention = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        out, _ = attention(self, q, k, v, None, scaling=head_dim ** -0.5, dropout=0.0,
                           sliding_window=self.config.window, cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                           max_length_q=int(lengths.max()), max_length_k=int(lengths.max()))
        return self.out(out.reshape(tokens, -1))


def build(seed: int = 0) -> PackedWindowModel:
    torch.manual_seed(seed)
    return PackedWindowModel(PackedWindowConfig(attn_implementation="sdpa")).eval()
