"""What the notebooks call (layer: notebook, the top; may import every layer).

The live dashboard, the notebooks' helpers and the Colab set-up.
"""
