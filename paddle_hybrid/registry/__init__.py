"""The registry's base, below the features: what a feature declares and how one component
installs itself (:mod:`.component`), every change through a :class:`~.patching.Patcher`, the
additions to fleet's and Paddle's own registries (:mod:`.paddle_registries`), every on/off question
answered by one gate (:mod:`.gate`) from the facts of where a run is (:mod:`.device`).

Its top, above the features, is :mod:`paddle_hybrid.catalog`: the list of every component and
their installation all or none.  Nothing is imported here.
"""
