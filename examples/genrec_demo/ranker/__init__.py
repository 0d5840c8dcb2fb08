"""The demo's HSTU ranker: the second stage of the funnel, reordering the Qwen3's retrieved items.

events.py     a user's rated items as HSTU events (training rows and ranking requests alike)
config.py     the recipe (RankerConfig) and the HSTUConfig it builds
forward.py    a differentiable dense forward of the served model's math (training)
train.py      training on every user's training items, a fixed number of steps
model_dir.py  the model directory (genrec's HSTU layout + the recipe), reused while the recipe matches
evaluate.py   rank retrieved lists with the served Engine
"""

from genrec_demo.ranker.config import RankerConfig
from genrec_demo.ranker.evaluate import rank_retrieved
from genrec_demo.ranker.model_dir import DEFAULT_DIR, prepare_ranker

__all__ = ["DEFAULT_DIR", "RankerConfig", "prepare_ranker", "rank_retrieved"]
