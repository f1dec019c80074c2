<?php

// The stand-in's bootstrap, where Phorge's scripts/init/init-script.php is.

$standin_down = getenv('STANDIN_DOWN_FILE');
if ($standin_down && file_exists($standin_down)) {
  // What Phorge throws when no database host answers.
  throw new Exception(
    'PhabricatorClusterStrandedException: Unable to establish a connection '.
    'to any database host (while trying "default"). All masters and replicas '.
    'are completely unreachable.');
}

require_once dirname(__FILE__).'/../../src/libphutil.php';
require_once dirname(__FILE__).'/../../src/queue.php';
require_once dirname(__FILE__).'/../../src/workers.php';
