"""How the plugin changes Paddle: components declared by the features (:mod:`.component`), listed
in install order (:mod:`.catalog`), installed all or none and undone (:mod:`.install`), every
change through a :class:`~.patching.Patcher`, every on/off question answered by one gate
(:mod:`.gate`) from the facts of where a run is (:mod:`.device`).

Nothing is imported here: a feature imports :mod:`.component` while the catalog imports the
features.
"""
