"""Models whose parameters are split over a ('data', 'model') device mesh.

`mlp` annotates each weight with the mesh axes it is split over and lets XLA's
SPMD partitioner place the computation; `fsdp` splits the weights over the
data axis itself, inside `shard_map`, and gathers them for each layer.
"""

DATA_AXIS = 'data'
MODEL_AXIS = 'model'
MESH_AXES = (DATA_AXIS, MODEL_AXIS)
