"""memfit inside other libraries' training loops: the Hugging Face Trainer's callback
(``hf_trainer``, reached as ``memfit.hf.MemfitCallback``), Lightning's (``lightning``), and what they
and the accelerate recipe share (``trainers``). Each imports its library only when used."""
