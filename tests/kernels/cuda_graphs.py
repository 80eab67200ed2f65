"""CUDA-graph capture for the GPU tests that replay a backward on new inputs (as `rewy-tune bench` measures it)."""

import torch


def capture(fn):
    """(graph, outputs) of `fn` captured in a CUDA graph, after one eager call on a side stream (the compiles,
    outside the graph). Copy new inputs into the tensors `fn` reads, then `graph.replay()` rewrites the outputs."""
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph, outs
