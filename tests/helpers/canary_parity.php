<?php

/**
 * PhorgeBridgeCanary's pure part (bucket, option parsing, the side chosen) under
 * plain php-cli, without Phorge: tests/unit/test_canary_php_parity.py runs it
 * once for its whole table and compares every answer with Python's.
 *
 * Reads one JSON request on stdin:
 *
 *   {"buckets": {"levels": [...], "ids": [...]},
 *    "reads": [{"rows": {option: raw JSON} or null (unreadable), "classes": [...]}],
 *    "cases": [{"weights": raw JSON or null, "state": raw JSON or null,
 *               "classes": [...], "ids": [...], "failures": [null, 0, ...]}]}
 *
 * and writes one JSON answer on stdout: the buckets per level, and per case
 * each option's refusal (its message) or, when both are accepted, the weights
 * of the classes (as they are, and closed: newClosed()), the named classes
 * and, per class, level and failure time, a string of "1" (the new side takes
 * the id) and "0". A case is read as
 * PhorgeBridgeCanary::refresh() reads the config rows (decodeValue(), then the
 * parsers); anything but the canary's own exception (a PHP warning included)
 * is a "crash", which the test reports. Then one canary is refreshed after
 * each of "reads" (the config table as it is then) and the answer adds the
 * weights it gives each class after each read, and the lines it logged.
 *
 * The shims below stand for the three libphutil functions the pure part calls;
 * idx() and array_fuse() are arcanist's (src/utils/utils.php), pht() is what
 * PhutilTranslator::translate() does with no translation loaded: vsprintf().
 */

if (!function_exists('idx')) {
  function idx(array $array, $key, $default = null) {
    // isset() is a micro-optimization - it is fast but fails for null values.
    if (isset($array[$key])) {
      return $array[$key];
    }

    // Comparing $default is also a micro-optimization.
    if ($default === null || array_key_exists($key, $array)) {
      return null;
    }

    return $default;
  }
}

if (!function_exists('array_fuse')) {
  function array_fuse(array $list) {
    if ($list) {
      return array_combine($list, $list);
    }
    return array();
  }
}

if (!function_exists('pht')) {
  function pht($text /* , ... */) {
    $args = func_get_args();
    array_shift($args);
    return vsprintf($text, $args);
  }
}

// The config table PhorgeBridgeCanary::readOptions() reads, for the request's
// "reads": its rows, or null while it can not be read (as a revoked grant).
final class PhabricatorConfigEntry {
  public static $rows = array();

  public function establishConnection($mode) {
    if (self::$rows === null) {
      throw new Exception('SELECT command denied');
    }
    return null;
  }

  public function getTableName() {
    return 'config_entry';
  }
}

function queryfx_all($conn, $pattern /* , ... */) {
  return PhabricatorConfigEntry::$rows;
}

function ipull(array $list, $index, $key_index) {
  $out = array();
  foreach ($list as $row) {
    $out[$row[$key_index]] = $row[$index];
  }
  return $out;
}

function phlog($value) {
  $GLOBALS['canary_parity_logged']++;
}

// Every warning and notice is a failure of the case it happens in.
set_error_handler(
  function ($severity, $message, $file, $line) {
    throw new ErrorException($message, 0, $severity, $file, $line);
  });

require_once $argv[1];

function canary_parity_option($option, $raw, $decode) {
  try {
    $value = $decode->invoke(null, $option, $raw);
    if ($option === PhorgeBridgeCanary::OPTION) {
      PhorgeBridgeCanary::parseWeights($value);
    } else {
      PhorgeBridgeCanary::parseState($value);
    }
    return array($value, null);
  } catch (PhorgeBridgeCanaryConfigException $ex) {
    return array(null, $ex->getMessage());
  }
}

function canary_parity_case(array $case, $decode) {
  list($weights, $weights_refused) = canary_parity_option(
    PhorgeBridgeCanary::OPTION,
    $case['weights'],
    $decode);
  list($state, $state_refused) = canary_parity_option(
    PhorgeBridgeCanary::STATE_OPTION,
    $case['state'],
    $decode);
  $out = array(
    'weightsRefused' => $weights_refused,
    'stateRefused' => $state_refused,
  );
  if ($weights_refused !== null || $state_refused !== null) {
    return $out;
  }

  $canary = PhorgeBridgeCanary::newFromValues($weights, $state);
  $levels = array(
    PhorgeBridgeCanary::LEVEL_CELERY,
    PhorgeBridgeCanary::LEVEL_PYTHON,
  );
  $closed = $canary->newClosed();
  $out['named'] = $canary->getNamedClasses();
  $out['weights'] = array();
  $out['closed'] = array();
  $out['takes'] = array();
  foreach ($case['classes'] as $class) {
    foreach ($levels as $level) {
      $out['weights'][$class][$level] = $canary->getWeight($class, $level);
      $out['closed'][$class][$level] = $closed->getWeight($class, $level);
      foreach ($case['failures'] as $failure) {
        $bits = '';
        foreach ($case['ids'] as $id) {
          $bits .= $canary->takes($level, $class, $id, $failure) ? '1' : '0';
        }
        $key = ($failure === null) ? 'null' : (string)$failure;
        $out['takes'][$class][$level][$key] = $bits;
      }
    }
  }
  return $out;
}

$request = json_decode(file_get_contents('php://stdin'), true);

$decode = new ReflectionMethod('PhorgeBridgeCanary', 'decodeValue');
$decode->setAccessible(true);

$buckets = array();
foreach ($request['buckets']['levels'] as $level) {
  $buckets[$level] = array();
  foreach ($request['buckets']['ids'] as $id) {
    $buckets[$level][] = PhorgeBridgeCanary::bucket($level, $id);
  }
}

$cases = array();
foreach ($request['cases'] as $case) {
  try {
    $cases[] = canary_parity_case($case, $decode);
  } catch (Throwable $ex) {
    $cases[] = array(
      'crash' => get_class($ex).': '.$ex->getMessage().' at line '.$ex->getLine(),
    );
  }
}

// One canary refreshed after each read, as the shipped daemon refreshes it:
// the weights in force of each class and level, and the lines logged.
$GLOBALS['canary_parity_logged'] = 0;
$reader = new PhorgeBridgeCanary();
$read_at = new ReflectionProperty('PhorgeBridgeCanary', 'readAt');
$read_at->setAccessible(true);
$reads = array();
foreach ($request['reads'] as $read) {
  PhabricatorConfigEntry::$rows = null;
  if ($read['rows'] !== null) {
    PhabricatorConfigEntry::$rows = array();
    foreach ($read['rows'] as $key => $value) {
      PhabricatorConfigEntry::$rows[] = array(
        'configKey' => $key,
        'value' => $value,
      );
    }
  }
  $read_at->setValue($reader, null);  // past REFRESH_SECONDS
  $canary = $reader->refresh();
  $weights = array();
  foreach ($read['classes'] as $class) {
    foreach (array(PhorgeBridgeCanary::LEVEL_CELERY, PhorgeBridgeCanary::LEVEL_PYTHON) as $level) {
      $weights[$class][$level] = $canary->getWeight($class, $level);
    }
  }
  $reads[] = $weights;
}

echo json_encode(
  array(
    'buckets' => $buckets,
    'cases' => $cases,
    'reads' => $reads,
    'logged' => $GLOBALS['canary_parity_logged'],
  ));
