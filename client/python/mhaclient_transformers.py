"""transformers on mhaserve: the service as an attention implementation, and a cache whose layers live in one head
session of the server, so that `model.generate(...)` runs every layer's attention there and sends only each step's
new tokens. Needs torch and transformers (5.x), which the mhaclient package itself does not depend on.

    import mhaclient, mhaclient_transformers
    client = mhaclient.MhaClient("127.0.0.1:50051")
    mhaclient_transformers.register(client)                    # attn_implementation "mhaserve"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="mhaserve")
    with mhaclient_transformers.ServiceCache(client, model) as cache:
        tokens = model.generate(ids, max_new_tokens=32, do_sample=False, cache=cache)

How it works: the model still projects and rotates q and k itself (its RoPE, scaled or not, and its biases); the
cache's update() keeps nothing but counts the tokens and hands the new k and v on, marked with their layer; the
attention function sends q and those k, v to that layer's cache in the session (a head session of num_layers caches
without RoPE, each cache with its layer's scale: `layer_heads`), which appends them and attends over everything
cached. Without a ServiceCache (an encoder, or use_cache=False) the attention function makes a stateless
ScaledDotProductAttention call with the model's mask (padding included). Rows of a batch are sessions of their own;
a batch whose rows are padded (a mask that is not plain causal) is refused in a session, as are beam search and
other cache reorderings (NotImplementedError)."""

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "mhaserve"
_client = None  # register()'s, for the stateless path


def register(client, name=NAME):
    """Registers the service as attention implementation `name` (and its mask function: transformers' boolean
    sdpa masks, None when plain causal) with this client for the stateless calls."""
    global _client
    _client = client
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)


def _numpy(t):
    return t.detach().to(torch.float32).cpu().numpy()


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention function: query [B, H, Tq, d], key and value [B, Hkv, Tk, d] (already rotated);
    returns ([B, Tq, H, d], None)."""
    layer = getattr(key, "_mha_layer", None)
    if layer is not None:
        out = layer.cache._attend(layer.index, query, key, value, attention_mask)
    else:
        out = _stateless(module, query, key, value, attention_mask, scaling)
    return torch.from_numpy(np.ascontiguousarray(out)).to(query.dtype), None


def _stateless(module, query, key, value, attention_mask, scaling):
    if _client is None:
        raise RuntimeError("mhaclient_transformers.register(client) first")
    mask = None
    if attention_mask is not None:  # [B or 1, 1, Tq, Tk]: True attends (sdpa masks) or additive (eager)
        m = attention_mask[:, 0].detach().cpu().numpy()
        mask = m if m.dtype == np.bool_ else m.astype(np.float32)
    causal = bool(getattr(module, "is_causal", False)) and mask is None
    return _client.scaled_dot_product_attention(
        _numpy(query.transpose(1, 2)), _numpy(key.transpose(1, 2)), _numpy(value.transpose(1, 2)), causal=causal,
        scale=0.0 if scaling is None else float(scaling), attn_mask=mask).output


class _SessionLayer(DynamicLayer):
    """One model layer's cache: its tokens live in the session's cache `index`; update() only counts them and marks
    the new k and v for the attention function."""

    def __init__(self, cache, index):
        super().__init__()
        self.cache, self.index, self.length = cache, index, 0

    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.length += key_states.shape[-2]
        key_states._mha_layer = self
        return key_states, value_states

    def get_seq_length(self):
        return self.length

    def get_mask_sizes(self, query_length):
        return self.length + query_length, 0

    def crop(self, tokens_to_remove):
        """Drops the last -tokens_to_remove tokens (transformers 5 passes a negative count), as assisted decoding
        does with rejected ones: layer 0 truncates the session, which holds every layer's cache."""
        length = max(0, self.length - abs(tokens_to_remove))
        if length < self.length:
            if self.index == 0:
                self.cache._truncate(length)
            self.length = length

    def reset(self):
        self.cache._close()
        self.length, self.is_initialized = 0, False

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("a ServiceCache does not reorder its rows (beam search); use greedy or sampling")

    def batch_repeat_interleave(self, repeats):
        raise NotImplementedError("a ServiceCache does not repeat its rows; fork the sessions instead")

    def batch_select_indices(self, indices):
        raise NotImplementedError("a ServiceCache does not select rows")


class ServiceCache(Cache):
    """A transformers Cache whose layers live on the server: one head session per batch row, with one cache per
    model layer at that layer's scale, created at the first attention call and closed by close() (or the `with`
    block's end). cache_dtype: None (fp32), 'fp16', 'bf16', 'int8', 'fp8_e4m3' or 'fp8_e5m2'."""

    def __init__(self, client, model, cache_dtype=None):
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
        self._scales = {m.layer_idx: float(m.scaling) for m in modules}
        self._layers = getattr(config, "num_hidden_layers", None) or config.n_layer
        super().__init__(layers=[_SessionLayer(self, i) for i in range(self._layers)])
        heads = config.num_attention_heads
        self._heads = (heads, getattr(config, "num_key_value_heads", None) or heads,
                       getattr(config, "head_dim", None) or config.hidden_size // heads)
        self._client, self._dtype, self._sessions = client, cache_dtype, []

    def _open(self, batch):
        if len(self._scales) != self._layers:
            raise ValueError("ServiceCache: found %d attention modules with a scale for %d layers"
                             % (len(self._scales), self._layers))
        heads, kv_heads, head_dim = self._heads
        self._sessions = [self._client.create_session(
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, num_layers=self._layers,
            cache_dtype=self._dtype, layer_heads=[{"scale": self._scales[i]} for i in range(self._layers)])
            for _ in range(batch)]

    def _attend(self, index, query, key, value, attention_mask):
        if attention_mask is not None:
            raise NotImplementedError("a ServiceCache takes rows without padding (equal lengths, or one row); "
                                      "this call's mask is not plain causal")
        batch = query.shape[0]
        if not self._sessions:
            self._open(batch)
        items = [{"session": s, "q": _numpy(query[b].transpose(0, 1)), "k": _numpy(key[b].transpose(0, 1)),
                  "v": _numpy(value[b].transpose(0, 1))} for b, s in enumerate(self._sessions)]
        results = self._client.extend(items, layer_index=index)
        return np.stack([r.output for r in results])

    def _truncate(self, length):
        for s in self._sessions:
            s.truncate(length)

    def _close(self):
        for s in self._sessions:
            s.close()
        self._sessions = []

    def close(self):
        self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
