"""The attention benchmark: `python -m probjax_nn.benchmark` measures, `... plot FILE` draws, `... decode`
measures decode steps against a KV cache.

Its JSON has the schema of the seed benchmark file (`device`, `config`, `results`, the same row keys). Not
imported by `import probjax_nn`; matplotlib and torch are imported only by the parts that need them.
"""

from probjax_nn.benchmark._main import main as main
