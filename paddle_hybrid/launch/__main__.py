"""``python -m paddle_hybrid.launch [Paddle launcher arguments] train.py [script arguments]``."""
from . import main

main()
