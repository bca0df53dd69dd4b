"""fgrpo's embedded worlds, each whole in one place: its world (grammar, renderer or simulator),
prompt source, verifier or rewards, evaluators, small policy, pretraining and shipped base weights.

- :mod:`fgrpo.worlds.shapes`: compositional text-to-image on 24x24 pixels (GenEval at laptop scale);
- :mod:`fgrpo.worlds.shapes_edit`: instruction-based image editing on the shapes grid;
- :mod:`fgrpo.worlds.driving`: a flow-matching trajectory planner in a closed-loop highway
  simulator, with highway-env as an external judge.

Recipes name the components as before (``shapes``, ``shapes-dit``, ``driving-rollout``, ...): they
are registered through this package's entry points, like every other component."""
