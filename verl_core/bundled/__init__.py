"""What ships inside the package: the embedded tiny model built locally (:mod:`.tiny_model`) and the
bundled verifiable task, arithmetic word problems (:mod:`.arithmetic`)."""
