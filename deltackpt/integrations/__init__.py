"""Ways in from the frameworks users checkpoint through, one module each.

A module imports its framework only when it is used, and checks that its version is one
deltackpt is tested with (:func:`~deltackpt.integrations.frameworks.require`); each framework
is an optional extra (``pip install 'deltackpt[transformers]'``).
"""
