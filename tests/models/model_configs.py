"""Small seeded configurations of the architectures the model checks cover (random weights, no download), shared by
tests/models/test_*.py."""

import transformers

SMALL = dict(vocab_size=97, num_hidden_layers=2, max_position_embeddings=256)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 10000.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}


def attention_modules(model):
    """Each decoder layer's attention module, in layer order (LLaMA-likes' self_attn, GPT-2's attn, NeoX's
    attention)."""
    return [m for name, m in model.named_modules() if name.endswith((".self_attn", ".attn", ".attention"))
            and not name.endswith(".attention.attention")]


def configs(spread=0.02):
    """model_type -> (config, save_pretrained's extra arguments); `spread`: the weights' initializer_range (a wide
    one keeps greedy decoding of random weights from repeating one token)."""
    init = dict(initializer_range=spread)
    return {
        "llama": (transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                           num_key_value_heads=2, rope_parameters=LLAMA3, **SMALL, **init),
                  {"max_shard_size": "40KB"}),  # several shards and their index
        "mistral": (transformers.MistralConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                               num_key_value_heads=1, sliding_window=None, **SMALL, **init), {}),
        "qwen2": (transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                           num_key_value_heads=2, rope_parameters=YARN, **SMALL, **init),
                  {}),  # q, k, v biases
        "phi3": (transformers.Phi3Config(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                         num_key_value_heads=2, partial_rotary_factor=0.5, sliding_window=None,
                                         pad_token_id=0, **SMALL, **init), {}),
        "gpt2": (transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                         scale_attn_by_inverse_layer_idx=True, **init), {}),
        "gpt_neox": (transformers.GPTNeoXConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                                rotary_pct=0.25, **SMALL, **init), {}),
    }
