"""The attention benchmark: `python -m probjax_nn.benchmark` measures, `... plot FILE` draws.

Its JSON has the schema of the seed benchmark file (`device`, `config`, `results`, the same row keys). Not
imported by `import probjax_nn`; matplotlib and torch are imported only by the parts that need them.
"""

from probjax_nn.benchmark._cli import main as main
