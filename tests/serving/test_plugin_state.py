"""The plugin's view of the engine (:mod:`quantmla.serving.vllm.plugin_state`), on stand-in configs."""

from types import SimpleNamespace

from quantmla.serving.vllm import plugin_state


def test_graph_min_batch_is_one_past_the_next_smaller_captured_size(monkeypatch):
    """vLLM pads a decode batch to the smallest captured size that holds it: the graph of 48 replays 41-48
    requests, the graph of 8 replays 5-8, the graph of 1 only 1."""
    sizes = [1, 2, 4] + list(range(8, 104, 8))
    cfg = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_capture_sizes=list(reversed(sizes))))
    monkeypatch.setattr(plugin_state, "_config", lambda: cfg)
    got = plugin_state.capture_sizes()
    assert got == sizes
    assert [plugin_state.graph_min_batch(b, got) for b in (1, 2, 4, 8, 16, 48, 96)] == [1, 2, 3, 5, 9, 41, 89]
    monkeypatch.setattr(plugin_state, "_config", lambda: None)
    assert plugin_state.capture_sizes() is None
    assert plugin_state.graph_min_batch(48, None) is None
