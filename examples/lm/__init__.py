"""The language-model example's modules: config, data, one model file per framework, training, sampling.

examples/train_lm.py and examples/sample.py put examples/ on sys.path and import this folder as `lm`.
"""
